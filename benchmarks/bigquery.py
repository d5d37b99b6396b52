"""Rows/s reading one BigQuery table on the bqemulator (loopback): REST ``list_rows`` (the fallback) vs the
Storage Read API (Arrow streams), both through ``vertexrt.data.BigQuery`` and handing out dicts, plus Storage
Read as Arrow batches (``columnar=True`` path), and ``open_dataset("bq://...")`` end to end (plan, shuffle
buffer, cursor, prefetch thread: what a training loop gets).

    .venv/bin/python benchmarks/bigquery.py [--rows 200000] [--repeats 3]

Needs ``.venv/bqemu`` (``make install``). Median of ``--repeats`` runs; session creation is included.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=200_000)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    from bqemulator_launcher import BigQueryEmulator

    from vertexrt.clients import bigquery_client
    from vertexrt.data import BigQuery, open_dataset
    from vertexrt.data.formats.base import Errors
    from vertexrt.data.sources import parse_table

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    python = os.environ.get("VERTEXRT_BQEMU_PYTHON") or os.path.join(root, ".venv", "bqemu", "bin", "python")
    log = os.path.join(tempfile.mkdtemp(), "bqemulator.log")
    with BigQueryEmulator(python, log) as emu:
        os.environ.update(
            BIGQUERY_EMULATOR_HOST=emu.rest_endpoint,
            STORAGE_READ_EMULATOR_HOST=emu.grpc_endpoint,
            GOOGLE_CLOUD_PROJECT="bench",
        )
        client = bigquery_client("bench")
        client.create_dataset("ds", exists_ok=True)
        client.query(
            "CREATE TABLE ds.t AS SELECT x AS id, CONCAT('name-', CAST(x AS STRING)) AS name, x / 8 AS score "
            f"FROM UNNEST(GENERATE_ARRAY(0, {args.rows - 1})) AS x"
        ).result()
        table = parse_table("bq://bench.ds.t")
        fmt = BigQuery(streams=4)

        def list_rows() -> int:
            return sum(len(rows) for _, rows in fmt.read(table, 0, None, Errors()))

        def storage(columnar: bool) -> int:
            streams = fmt.plan(table, rank=0, world_size=1) or []
            read = fmt.read_columns if columnar else fmt.read
            return sum(len(part) for s in streams for _, part in read(s, 0, None, Errors()))

        def dataset(shuffle: bool) -> int:
            ds = open_dataset("bq://bench.ds.t", format=fmt, shuffle=shuffle, rank=0, world_size=1)
            return sum(1 for _ in ds)

        cases = [
            ("list_rows (REST) -> dicts", list_rows),
            ("Storage Read (Arrow) -> dicts", lambda: storage(False)),
            ("Storage Read (Arrow) -> columns", lambda: storage(True)),
            ("open_dataset(bq://), no shuffle", lambda: dataset(False)),
            ("open_dataset(bq://), shuffled", lambda: dataset(True)),
        ]
        rates = {}
        for name, run in cases:
            times = []
            for _ in range(args.repeats):
                began = time.perf_counter()
                assert run() == args.rows
                times.append(time.perf_counter() - began)
            rates[name] = args.rows / statistics.median(times)
    base = rates[cases[0][0]]
    print(f"{'path':34} {'rows/s':>12} {'vs list_rows':>12}")
    for name, rate in rates.items():
        print(f"{name:34} {rate:12,.0f} {rate / base:11.1f}x")


if __name__ == "__main__":
    main()

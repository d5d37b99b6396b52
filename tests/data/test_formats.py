"""Every format on local disk and on the GCS server: JSONL, gzip text, CSV/TSV, Parquet."""

from __future__ import annotations

import gzip
import io

import pytest

from vertexrt import paths
from vertexrt.data import CSV, JSONL, Parquet, open_dataset

from .conftest import read_all, write_bytes

RECORDS = [{"id": i, "text": f"row {i}", "score": i / 4, "tags": ["a", "b"][: i % 3]} for i in range(500)]


@pytest.mark.parametrize("gz", [False, True])
def test_jsonl_plain_and_gzip(storage_root: str, write_jsonl, gz: bool) -> None:
    uri = paths.join(storage_root, f"d.jsonl{'.gz' if gz else ''}")
    write_jsonl(uri, RECORDS, gz=gz)
    assert read_all(uri) == RECORDS


def test_jsonl_crlf_no_final_newline_and_blank_lines(storage_root: str) -> None:
    uri = write_bytes(paths.join(storage_root, "x.jsonl"), b'{"a": 1}\r\n\r\n  \n{"a": 2}\n{"a": 3}')
    assert read_all(uri) == [{"a": 1}, {"a": 2}, {"a": 3}]


def test_jsonl_records_larger_than_a_read(tmp_path) -> None:
    big = [{"blob": "x" * (9 << 20)}, {"blob": "y"}]
    path = tmp_path / "big.jsonl"
    path.write_bytes(b"".join(f'{{"blob": "{r["blob"]}"}}\n'.encode() for r in big))
    assert read_all(str(path)) == big


@pytest.mark.parametrize("gz", [False, True])
def test_csv_header_types_quotes(storage_root: str, gz: bool) -> None:
    text = 'id,name,score\n1,"Smith, J",0.5\n2,"multi\nline ""quoted""",\n3,plain,2\n'
    data = text.encode()
    uri = write_bytes(
        paths.join(storage_root, f"c.csv{'.gz' if gz else ''}"), gzip.compress(data) if gz else data
    )
    assert read_all(uri, format=CSV(types={"id": int, "score": float})) == [
        {"id": 1, "name": "Smith, J", "score": 0.5},
        {"id": 2, "name": 'multi\nline "quoted"', "score": None},
        {"id": 3, "name": "plain", "score": 2.0},
    ]
    assert read_all(uri)[0] == {"id": "1", "name": "Smith, J", "score": "0.5"}  # strings by default


def test_tsv_and_headerless_csv(storage_root: str) -> None:
    tsv = write_bytes(paths.join(storage_root, "t.tsv"), b"a\tb\n1\t2\n")
    assert read_all(tsv) == [{"a": "1", "b": "2"}]
    raw = write_bytes(paths.join(storage_root, "n.csv"), b"1,2\n3,4\n")
    assert read_all(raw, format=CSV(columns=["x", "y"], types={"x": int})) == [
        {"x": 1, "y": "2"},
        {"x": 3, "y": "4"},
    ]


def test_csv_many_files_each_with_a_header_sharded(storage_root: str) -> None:
    for part in range(3):
        rows = "".join(f"{part * 100 + i},v\n" for i in range(40))
        write_bytes(paths.join(storage_root, f"training-{part:05d}-of-00003.csv"), f"id,v\n{rows}".encode())
    seen = []
    for rank in range(4):  # 3 files, 4 readers: record striding
        ds = open_dataset(
            paths.join(storage_root, "training-*"),
            format=CSV(types={"id": int}),
            rank=rank,
            world_size=4,
            seed=1,
        )
        seen += [r["id"] for r in ds]
    assert sorted(seen) == sorted(p * 100 + i for p in range(3) for i in range(40))


def test_parquet_row_groups_columns_and_resume(storage_root: str) -> None:
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    table = pa.table(
        {"id": list(range(1000)), "x": [i * 0.5 for i in range(1000)], "s": [str(i) for i in range(1000)]}
    )
    sink = io.BytesIO()
    pq.write_table(table, sink, row_group_size=128)
    uri = write_bytes(paths.join(storage_root, "p.parquet"), sink.getvalue())
    assert read_all(uri) == table.to_pylist()
    assert read_all(uri, format=Parquet(columns=["id"], batch_rows=50))[:2] == [{"id": 0}, {"id": 1}]
    ds = open_dataset(uri, format=Parquet(batch_rows=100), shuffle=False, rank=0, world_size=1)
    it = iter(ds)
    head = [next(it)["id"] for _ in range(333)]
    state = ds.state_dict()
    assert state["cursors"]["0"]["pos"] + state["cursors"]["0"]["skip"] == 333  # a row index
    again = open_dataset(uri, format=Parquet(batch_rows=100), shuffle=False, rank=0, world_size=1)
    again.load_state_dict(state)
    assert head + [r["id"] for r in again] == list(range(1000))


def test_parquet_sharded_exactly_once(storage_root: str) -> None:
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    for part in range(2):
        sink = io.BytesIO()
        pq.write_table(pa.table({"id": list(range(part * 300, part * 300 + 300))}), sink, row_group_size=64)
        write_bytes(paths.join(storage_root, f"p{part}.parquet"), sink.getvalue())
    seen = []
    for rank in range(3):
        ds = open_dataset(paths.join(storage_root, "*.parquet"), rank=rank, world_size=3, shuffle_buffer=50)
        seen += [r["id"] for r in ds]
    assert sorted(seen) == list(range(600))


def test_format_from_environment(storage_root: str, vertex_env, write_jsonl) -> None:
    write_jsonl(paths.join(storage_root, "training-00000-of-00001"), [{"a": 1}])
    write_jsonl(paths.join(storage_root, "validation-00000-of-00001"), [{"a": 2}])
    vertex_env(
        extra={
            "AIP_DATA_FORMAT": "jsonl",
            "AIP_TRAINING_DATA_URI": paths.join(storage_root, "training-*"),
            "AIP_VALIDATION_DATA_URI": paths.join(storage_root, "validation-*"),
        }
    )
    from vertexrt.data import validation_dataset

    assert list(open_dataset(rank=0, world_size=1)) == [{"a": 1}]
    assert list(validation_dataset(rank=0, world_size=1)) == [{"a": 2}]
    assert JSONL() == open_dataset(rank=0, world_size=1).format


def test_decoded_records_die_young_the_garbage_collector_stays_idle(tmp_path) -> None:
    # records are decoded a short run at a time: a long run of nested records held alive at once would
    # trigger collections, each walking the whole heap (a framework's) from time to time
    import gc
    import json

    record = {"id": 0, "tags": ["a", "b"], "m": {"k": [1, {"z": []}]}}  # 6 containers
    path = tmp_path / "nested.jsonl"
    path.write_bytes((json.dumps(record) + "\n").encode() * 20_000)
    ds = open_dataset(str(path), shuffle=False, rank=0, world_size=1)
    gc.collect()
    before = [s["collections"] for s in gc.get_stats()]
    n = 0
    for _ in ds:
        n += 1
    after = [s["collections"] for s in gc.get_stats()]
    assert n == 20_000
    assert after[0] - before[0] <= 2, f"young-generation collections while reading: {after[0] - before[0]}"


def test_parquet_rows_are_handed_out_in_slices_of_at_most_1024_at_their_exact_row(tmp_path) -> None:
    """Fewer row dicts alive at once: a record batch of 8192 rows becomes slices of <= 1024, each at the
    row index of its first row (a cursor resumes inside the batch)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from vertexrt.data.formats.base import Errors, FileSource

    path = tmp_path / "big.parquet"
    pq.write_table(pa.table({"id": range(5000)}), path, row_group_size=3000)
    source = FileSource(str(path), path.stat().st_size)
    for start, end in ((0, None), (1500, None), (7, 4100)):
        chunks = list(Parquet().read(source, start, end, Errors()))
        assert max(len(rows) for _, rows in chunks) <= 1024
        assert all(rows[0]["id"] == pos for pos, rows in chunks)
        assert [r["id"] for _, rows in chunks for r in rows] == list(range(start, end or 5000))

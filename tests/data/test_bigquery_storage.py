"""BigQuery Storage Read API against a real emulator (bqemulator: REST + gRPC), through the real clients and
the real cursor machinery; both a server that honours ``ReadRows.offset`` and one that ignores it."""

from __future__ import annotations

import dataclasses
import logging
import re
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from google.api_core import exceptions as gexc
from rank_exit import exits_hard

from vertexrt.data import BigQuery
from vertexrt.data.bigquery_storage import StreamSource
from vertexrt.data.cursor import Cursor, StreamSpec, chunks
from vertexrt.data.formats.base import Errors
from vertexrt.data.sharding import Unit, assign
from vertexrt.data.sources import parse_table
from vertexrt.errors import DataError

ROWS = 100_000  # ~2.6 MB: the emulator splits it into several streams; 2 messages of 65,536 rows per stream
SEEDED: set[str] = set()


@pytest.fixture(params=[True, False], ids=["offset-honoured", "offset-ignored"])
def emulator(request: pytest.FixtureRequest, bq_emulator: Callable[[bool], Any], monkeypatch) -> Any:
    return use(bq_emulator(request.param), monkeypatch)


def use(
    emu: Any, monkeypatch: pytest.MonkeyPatch, tables: tuple[str, ...] = ("big", "flaky", "resplit")
) -> Any:
    """Point the clients at ``emu`` for this test and create its tables of ``ROWS`` rows (once)."""
    monkeypatch.setenv("BIGQUERY_EMULATOR_HOST", emu.rest_endpoint)
    monkeypatch.setenv("STORAGE_READ_EMULATOR_HOST", emu.grpc_endpoint)
    monkeypatch.setenv("GOOGLE_CLOUD_PROJECT", "proj-1")
    monkeypatch.delenv("CLOUD_ML_PROJECT_ID", raising=False)
    if emu.rest_endpoint not in SEEDED:
        from vertexrt.clients import bigquery_client

        client = bigquery_client("proj-1")
        client.create_dataset("ds", exists_ok=True)
        for name in tables:
            client.query(
                f"CREATE TABLE ds.{name} AS SELECT x AS id, CONCAT('name-', CAST(x AS STRING)) AS name, "
                f"x / 8 AS score FROM UNNEST(GENERATE_ARRAY(0, {ROWS - 1})) AS x"
            ).result()
        SEEDED.add(emu.rest_endpoint)
    return emu


def plan(fmt: BigQuery, table: str = "big") -> list[StreamSource]:
    streams = fmt.plan(parse_table(f"bq://proj-1.ds.{table}"), rank=0, world_size=1)
    assert streams is not None
    return streams


def spec(fmt: BigQuery, streams: list[StreamSource], reader: int = 0, readers: int = 1) -> StreamSpec:
    """What the dataset builds for file-like sources: one unit per stream, file-level assignment."""
    units, stride, offset = assign([Unit(i) for i in range(len(streams))], reader, readers)
    return StreamSpec(fmt, streams, units, stride, offset, units, None, 1, 0, 0, reader, readers)


def ids(stream: Iterator[Any]) -> list[int]:
    return [row["id"] for chunk in stream for row in chunk.records]


def test_each_reader_reads_its_own_streams_and_every_row_once(emulator: Any) -> None:
    fmt = BigQuery(streams=4)
    streams = plan(fmt)
    assert len(streams) >= 3 and len({s.session for s in streams}) == 1
    seen = [i for r in range(3) for i in ids(chunks(spec(fmt, streams, r, 3), Cursor(), Errors()))]
    assert sorted(seen) == list(range(ROWS))


def test_columns_and_row_filter_pass_through(emulator: Any) -> None:
    fmt = BigQuery(columns=["id", "name"], row_filter="id < 1000 AND score >= 10", streams=1)
    rows = [row for chunk in chunks(spec(fmt, plan(fmt)), Cursor(), Errors()) for row in chunk.records]
    assert [r["id"] for r in rows] == list(range(80, 1000))
    assert set(rows[0]) == {"id", "name"} and rows[0]["name"] == "name-80"


@pytest.mark.parametrize("consumed", [1, 300, 70_000])
def test_resume_from_stream_and_row_offset_is_exact(emulator: Any, consumed: int) -> None:
    fmt = BigQuery(streams=2)
    streams = plan(fmt)
    whole = ids(chunks(spec(fmt, streams), Cursor(), Errors()))
    taken: list[int] = []
    cursor = Cursor()
    for chunk in chunks(spec(fmt, streams), Cursor(), Errors()):
        need = consumed - len(taken)
        taken += [row["id"] for row in chunk.records[:need]]
        if len(taken) == consumed:
            cursor = chunk.cursor_after(need)
            break
    assert cursor.pos is not None  # a row offset inside the stream
    with_restart = taken + ids(chunks(spec(fmt, streams), cursor, Errors()))
    assert with_restart == whole and sorted(whole) == list(range(ROWS))


def test_stream_failing_mid_read_is_retried_from_the_last_row(emulator: Any, caplog) -> None:
    fmt = BigQuery(streams=1)
    with caplog.at_level(logging.WARNING, logger="vertexrt.data.bigquery_storage"):
        got = ids(chunks(spec(fmt, plan(fmt, "flaky")), Cursor(), Errors()))
    assert got == list(range(ROWS))
    assert re.search(r"stream broke at row [1-9][0-9]* .*retrying from there", caplog.text)


def test_expired_session_is_replaced_and_the_log_says_so(emulator: Any, caplog) -> None:
    fmt = BigQuery(streams=2)
    fresh = plan(fmt)
    expired = [dataclasses.replace(s, expires=0.0) for s in fresh]
    with caplog.at_level(logging.WARNING, logger="vertexrt.data.bigquery_storage"):
        got = ids(chunks(spec(fmt, expired), Cursor(pos=10, skip=0), Errors()))
    assert "has expired; created session" in caplog.text and expired[0].session in caplog.text
    assert sorted(got) == sorted(ids(chunks(spec(fmt, fresh), Cursor(pos=10), Errors())))


def test_missing_table_is_a_data_error_naming_it(emulator: Any) -> None:
    with pytest.raises(DataError, match=r"(?s)bq://proj-1\.ds\.nope: .*check the table name"):
        BigQuery().plan(parse_table("bq://proj-1.ds.nope"), rank=0, world_size=1)


def test_without_the_storage_api_the_table_is_read_with_list_rows(emulator: Any, monkeypatch) -> None:
    from vertexrt._net import free_port

    monkeypatch.setenv("STORAGE_READ_EMULATOR_HOST", f"127.0.0.1:{free_port()}")  # nothing listens
    fmt = BigQuery(timeout=2.0)
    table = parse_table("bq://proj-1.ds.big")
    assert fmt.plan(table, rank=0, world_size=1) is None
    assert [r["id"] for _, rows in fmt.read(table, 10, 20, Errors()) for r in rows] == list(range(10, 20))
    with pytest.raises(DataError, match="row_filter='id > 3' needs the Storage Read API"):
        BigQuery(row_filter="id > 3", timeout=2.0).plan(table, rank=0, world_size=1)


def test_several_replicas_without_a_process_group_use_list_rows(emulator: Any) -> None:
    assert BigQuery().plan(parse_table("bq://proj-1.ds.big"), rank=1, world_size=2) is None


class Responses:
    """A ReadRows call: ``messages`` items, each after ``hold`` is set; ``cancel()`` ends it like gRPC."""

    def __init__(self, messages: int, hold: threading.Event):
        self.messages = messages
        self.hold = hold
        self.cancelled = threading.Event()

    def __iter__(self) -> Iterator[int]:
        for n in range(self.messages):
            while not self.hold.is_set():
                if self.cancelled.wait(0.01):
                    raise gexc.Cancelled("cancelled by the client")
            yield n

    def cancel(self) -> None:
        self.cancelled.set()


def test_idle_watch_cancels_a_silent_call_but_not_a_slow_consumer() -> None:
    from vertexrt.data.bigquery_storage import _IdleWatch

    going = threading.Event()
    going.set()
    slow = _IdleWatch(Responses(3, going), timeout=0.05)
    got = []
    for n in slow:
        got.append(n)
        time.sleep(0.2)  # the consumer's own time between messages does not count
    slow.close()
    assert got == [0, 1, 2] and not slow.fired

    silent = _IdleWatch(Responses(3, threading.Event()), timeout=0.05)
    with pytest.raises(gexc.Cancelled):
        list(silent)
    assert silent.fired


def test_missing_credentials_are_a_data_error_naming_the_fix(monkeypatch, tmp_path) -> None:
    for name in ("BIGQUERY_EMULATOR_HOST", "STORAGE_READ_EMULATOR_HOST"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("GOOGLE_APPLICATION_CREDENTIALS", str(tmp_path / "missing.json"))
    monkeypatch.setenv("GOOGLE_CLOUD_PROJECT", "proj-1")
    with pytest.raises(DataError, match=r"bq://proj-1\.ds\.t: no Google credentials .*application-default"):
        BigQuery().plan(parse_table("bq://proj-1.ds.t"), rank=0, world_size=1)


def test_a_rest_emulator_without_a_storage_emulator_reads_with_list_rows(monkeypatch) -> None:
    monkeypatch.setenv("BIGQUERY_EMULATOR_HOST", "http://127.0.0.1:9")
    monkeypatch.delenv("STORAGE_READ_EMULATOR_HOST", raising=False)
    monkeypatch.setenv("GOOGLE_CLOUD_PROJECT", "proj-1")
    assert BigQuery().plan(parse_table("bq://proj-1.ds.t"), rank=0, world_size=1) is None


@pytest.mark.parametrize(
    ("record", "key"),
    [
        ([], "not a mapping"),
        ({"name": "", "expires": 1.0, "streams": ["0"]}, "'name'"),
        ({"name": "s", "expires": float("nan"), "streams": ["0"]}, "'expires'"),
        ({"name": "s", "expires": 1.0, "streams": ["0"] * 10_001}, "'streams'"),
        ({"name": "s", "expires": 1.0, "streams": ["other/streams/0"]}, "'streams'"),
        ({"name": "s", "expires": 1.0, "streams": ["0"], "counts": [1, 2]}, "'counts'"),
        ({"name": "s", "expires": 1.0, "streams": ["0"], "counts": [-1]}, "'counts'"),
        ({"name": "s", "expires": 1.0, "streams": ["0"], "table": 7}, "'table'"),
        ({"name": "s", "expires": 1.0, "streams": ["0"], "columns": "id"}, "'columns'"),
        ({"name": "s", "expires": 1.0, "streams": ["0"], "row_filter": ["x"]}, "'row_filter'"),
    ],
)
def test_a_saved_session_is_checked_before_it_is_used(record: Any, key: str) -> None:
    from vertexrt.data.bigquery_session import check_record

    with pytest.raises(DataError, match=f"data state's 'session'.*{re.escape(key)}"):
        check_record(record)
    good = {"name": "s", "expires": 1.0, "streams": ["0", "s/streams/1"], "counts": [3, 4]}
    assert check_record(good) == {**good, "table": None, "columns": None, "row_filter": None}
    request = {"table": "p.d.t", "columns": ["x"], "row_filter": "x > 0"}
    assert check_record({**good, **request}) == {**good, **request}


@exits_hard
def _count_rank(rank: int, port: int, out: str) -> None:
    import datetime
    from pathlib import Path

    import torch.distributed as dist

    from vertexrt.data.bigquery_session import shared_counts

    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=2,
        timeout=datetime.timedelta(seconds=30),
    )
    streams = [StreamSource("p.d.t", "s", f"s/streams/{i}", i, 2, 0.0, b"") for i in range(2)]

    def count(stream: StreamSource) -> int:
        if stream.index == 1:  # counted by rank 1
            raise DataError(f"{stream.uri}: reading from row 0 failed 6 times (simulated)")
        return 10

    try:
        answer = f"counts {shared_counts(count, streams, rank, 2)}"
    except Exception as err:  # noqa: BLE001 - what each rank raised is the point of the test
        answer = f"{type(err).__name__}: {err}"
    finally:
        dist.destroy_process_group()
    Path(out, f"rank{rank}").write_text(answer)


@pytest.mark.slow
def test_a_stream_count_failing_on_one_rank_raises_the_same_data_error_on_every_rank(tmp_path) -> None:
    import socket
    from pathlib import Path

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(_count_rank, args=(port, str(tmp_path)), nprocs=2, start_method="spawn")
    answers = {Path(tmp_path, f"rank{r}").read_text() for r in range(2)}
    assert len(answers) == 1, answers
    (answer,) = answers
    assert answer.startswith("DataError: bq://p.d.t (stream 1 of 2): ") and "on rank 1" in answer
    assert "(simulated)" in answer

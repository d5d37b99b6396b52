"""BigQuery Storage Read under attack (issue 20): stream errors of every gRPC code, tampered resume offsets,
a saved session of another table, ranks that open different tables. Against the real emulator (bqemulator)."""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from typing import Any

import pytest

from vertexrt.data import BigQuery, open_dataset
from vertexrt.data.cursor import Cursor, chunks
from vertexrt.data.formats import Errors
from vertexrt.errors import DataError

from .test_bigquery_storage import ids, plan, spec, use

BIG = "bq://proj-1.ds.big"
FAIL_ROWS = 70_000  # two ReadRows messages (65,536 rows each) in one stream: an error arrives mid-stream
TRANSIENT = ["unavailable", "resource_exhausted", "internal", "deadline_exceeded", "aborted", "unknown"]
PERMANENT = [
    "unauthenticated",
    "permission_denied",
    "cancelled",
    "invalid_argument",
    "out_of_range",
    "data_loss",
    "unimplemented",
]
_MADE: set[tuple[str, str]] = set()


def table(emu: Any, name: str, rows: int = FAIL_ROWS) -> str:
    """Create ``ds.<name>`` of ``rows`` rows ``{id, name}`` on ``emu`` (once); its ``bq://`` URI."""
    if (emu.rest_endpoint, name) not in _MADE:
        from vertexrt.clients import bigquery_client

        bigquery_client("proj-1").query(
            f"CREATE TABLE ds.{name} AS SELECT x AS id, CONCAT('name-', CAST(x AS STRING)) AS name "
            f"FROM UNNEST(GENERATE_ARRAY(0, {rows - 1})) AS x"
        ).result()
        _MADE.add((emu.rest_endpoint, name))
    return f"bq://proj-1.ds.{name}"


@pytest.fixture(params=[True, False], ids=["offset-honoured", "offset-ignored"])
def emulator(request: pytest.FixtureRequest, bq_emulator: Callable[[bool], Any], monkeypatch) -> Any:
    return use(bq_emulator(request.param), monkeypatch)


@pytest.fixture
def honouring(bq_emulator: Callable[[bool], Any], monkeypatch) -> Any:
    return use(bq_emulator(True), monkeypatch)


@pytest.mark.parametrize("code", TRANSIENT)
def test_a_transient_stream_error_is_retried_from_the_last_row(emulator: Any, code: str) -> None:
    table(emulator, f"fail_{code}")
    fmt = BigQuery(streams=1)
    assert ids(chunks(spec(fmt, plan(fmt, f"fail_{code}")), Cursor(), Errors())) == list(range(FAIL_ROWS))


@pytest.mark.parametrize("code", PERMANENT)
def test_a_permanent_stream_error_is_a_data_error_naming_table_and_stream(honouring: Any, code: str) -> None:
    table(honouring, f"fail_{code}")
    fmt = BigQuery(streams=1)
    streams = plan(fmt, f"fail_{code}")
    with pytest.raises(DataError) as raised:
        ids(chunks(spec(fmt, streams), Cursor(), Errors()))
    message = str(raised.value)
    assert f"bq://proj-1.ds.fail_{code} (stream 0 of 1)" in message and "/streams/" in message
    assert code.upper() in message and re.search(r"from row [1-9][0-9]* ", message), message


def test_a_stream_gone_mid_read_continues_in_a_new_session(honouring: Any, caplog) -> None:
    table(honouring, "fail_not_found")
    fmt = BigQuery(streams=1)
    with caplog.at_level(logging.WARNING, logger="vertexrt.data.bigquery_storage"):
        got = ids(chunks(spec(fmt, plan(fmt, "fail_not_found")), Cursor(), Errors()))
    assert got == list(range(FAIL_ROWS)) and "is gone (NotFound); created session" in caplog.text


@pytest.mark.parametrize("offset", [-5, 10**12, 2**63])
def test_a_tampered_resume_offset_is_a_data_error(emulator: Any, offset: int) -> None:
    def opened() -> Any:
        return open_dataset(BIG, format=BigQuery(streams=2), shuffle=False, rank=0, world_size=1)

    ds = opened()
    assert len([row for row, _ in zip(ds, range(300), strict=False)]) == 300
    state = ds.state_dict()
    assert state["cursors"]["0"]["pos"] > 0  # a row offset in stream 0
    state["cursors"]["0"]["pos"] = offset
    again = opened()
    with pytest.raises(DataError, match=rf"bq://proj-1\.ds\.big.*{offset}"):
        again.load_state_dict(state)
        list(again)


def test_a_resume_offset_at_the_end_of_a_stream_is_valid(emulator: Any) -> None:
    fmt = BigQuery(streams=2)
    streams = plan(fmt)
    rows = fmt.count(streams[0], Errors())
    assert ids(chunks(spec(fmt, streams[:1]), Cursor(pos=rows), Errors())) == []
    with pytest.raises(DataError, match=rf"resume offset {rows + 1}"):
        ids(chunks(spec(fmt, streams[:1]), Cursor(pos=rows + 1), Errors()))

"""BigQuery Storage Read under attack (issue 20): stream errors of every gRPC code, tampered resume offsets,
a saved session of another table, ranks that open different tables. Against the real emulator (bqemulator)."""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from typing import Any

import pytest
from rank_exit import exits_hard

from vertexrt.data import BigQuery, open_dataset
from vertexrt.data.cursor import Cursor, chunks
from vertexrt.data.formats.base import Errors
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
    # Out of any stream's range (-5, 2**63): the data state's own validation names the field; in range but
    # past the stream's rows (10**12): the BigQuery reader names the table.
    with pytest.raises(DataError, match=rf"(bq://proj-1\.ds\.big|cursors\['0'\]\.pos=).*'?{offset}"):
        again.load_state_dict(state)
        list(again)


def test_a_resume_offset_at_or_past_the_end_of_a_stream_is_a_data_error(emulator: Any) -> None:
    """A saved cursor points at the start of a batch it read (then skips what it delivered), so no save
    points at a stream's end: a cursor there, or past it, was edited."""
    fmt = BigQuery(streams=2)
    streams = plan(fmt)
    rows = fmt.count(streams[0], Errors())
    with pytest.raises(DataError, match=rf"\({rows}, 0\)' points past the records of bq://proj-1\.ds\.big"):
        ids(chunks(spec(fmt, streams[:1]), Cursor(pos=rows), Errors()))
    with pytest.raises(DataError, match=rf"resume offset {rows + 1}"):
        ids(chunks(spec(fmt, streams[:1]), Cursor(pos=rows + 1), Errors()))


@pytest.mark.parametrize(
    ("other_table", "other_format", "differs"),
    [
        (
            "resplit",
            {},
            r"reads bq://proj-1\.ds\.resplit \(all columns, no row_filter\), .* bq://proj-1\.ds\.big",
        ),
        ("big", {"columns": ["id"]}, r"reads bq://proj-1\.ds\.big \(columns \['id'\], .*\(all columns"),
        ("big", {"row_filter": "id >= 5"}, r"row_filter='id >= 5'\), and this dataset reads .*no row_filter"),
    ],
    ids=["table", "columns", "row_filter"],
)
def test_resuming_with_the_saved_session_of_another_table_is_a_data_error(
    emulator: Any, other_table: str, other_format: dict[str, Any], differs: str
) -> None:
    def read_some(uri: str, **fmt: Any) -> dict[str, Any]:
        ds = open_dataset(uri, format=BigQuery(streams=2, **fmt), shuffle=False, rank=0, world_size=1)
        assert len([row for row, _ in zip(ds, range(300), strict=False)]) == 300
        return ds.state_dict()

    state = read_some(BIG)
    state["session"] = read_some(f"bq://proj-1.ds.{other_table}", **other_format)["session"]
    again = open_dataset(BIG, format=BigQuery(streams=2), shuffle=False, rank=0, world_size=1)
    with pytest.raises(DataError, match=rf"the data state's read session .*{differs}"):
        again.load_state_dict(state)
    planned = open_dataset(BIG, format=BigQuery(streams=2), shuffle=False, rank=0, world_size=1)
    planned.prepare()  # a plan made before the state is loaded (a DataLoader plans when it is made)
    with pytest.raises(DataError, match="the data state's read session"):
        planned.load_state_dict(state)


# -- ranks that open different reads -----------------------------------------------------------------
CASES = {  # case: (both ranks' format options, the table and options of rank 1); rank 0 opens BIG
    "same": ({}, "big", {}),
    "table": ({}, "resplit", {}),
    "columns": ({}, "big", {"columns": ["id"]}),
    "row_filter": ({}, "big", {"row_filter": "id >= 5"}),
    "list_rows": ({"storage_api": False}, "resplit", {}),
}


@exits_hard
def _opening_rank(rank: int, port: int, out: str) -> None:
    import json
    from pathlib import Path

    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    answers = {}
    for case, (both, name, fmt) in CASES.items():
        uri, options = (BIG, both) if rank == 0 else (f"bq://proj-1.ds.{name}", {**both, **fmt})
        ds = open_dataset(uri, format=BigQuery(streams=2, **options), shuffle=False)
        try:
            ds.prepare()
            answers[case] = f"session {(ds.state_dict()['session'] or {}).get('name')}"
        except DataError as err:
            answers[case] = f"DataError: {err}"
    Path(out, f"rank{rank}.json").write_text(json.dumps(answers))
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.slow
def test_ranks_that_open_different_tables_columns_or_filters_all_get_one_data_error(
    honouring: Any, monkeypatch, tmp_path
) -> None:
    import json
    import socket

    import torch.multiprocessing as mp

    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "CLUSTER_SPEC", "TF_CONFIG"):
        monkeypatch.delenv(name, raising=False)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(_opening_rank, args=(port, str(tmp_path)), nprocs=2, start_method="spawn")
    answers = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert answers[0]["same"] == answers[1]["same"] and answers[0]["same"].startswith("session ")
    differs = {
        "table": r"rank 1 reads bq://proj-1\.ds\.resplit \(all columns",
        "list_rows": r"rank 1 reads bq://proj-1\.ds\.resplit \(all columns",
        "columns": r"rank 1 reads bq://proj-1\.ds\.big \(columns \['id'\]",
        "row_filter": r"rank 1 reads bq://proj-1\.ds\.big \(all columns, row_filter='id >= 5'\)",
    }
    for case, words in differs.items():
        assert answers[0][case] == answers[1][case], case
        assert re.fullmatch(
            rf"DataError: the ranks open different BigQuery reads: rank 0 reads bq://proj-1\.ds\.big "
            rf"\(all columns, no row_filter\) and {words}.*same table with the same columns and row_filter.*",
            answers[0][case],
        ), answers[0][case]

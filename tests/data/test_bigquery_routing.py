"""``open_dataset("bq://...")`` reads through the BigQuery Storage Read API (one session, planned once, shared
by every rank) against the real bqemulator: exact resume, the fingerprint, two gloo ranks with DataLoader
workers, a stalled stream, and ``list_rows`` when the API is not there; a resume reuses the saved session
(table ``resplit`` is split differently by every session), an expiring session is renewed once per rank
in its main process, and ``count()`` of a table reads its metadata."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
import socket
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from rank_exit import exits_hard

from vertexrt.data import BigQuery, open_dataset
from vertexrt.data.bigquery_storage import create_session
from vertexrt.data.dataset import Dataset
from vertexrt.data.sources import parse_table
from vertexrt.errors import DataError

from .test_bigquery_storage import ROWS, use

TABLE = "bq://proj-1.ds.big"
RESPLIT = "bq://proj-1.ds.resplit"


@pytest.fixture(params=[True, False], ids=["offset-honoured", "offset-ignored"])
def emulator(request: pytest.FixtureRequest, bq_emulator: Callable[[bool], Any], monkeypatch) -> Any:
    return use(bq_emulator(request.param), monkeypatch)


def sessions(emu: Any) -> int:
    """CreateReadSession calls the emulator has answered (its JSON log)."""
    with open(emu.log_path, "rb") as log:
        return sum(b'"read_session.created"' in line for line in log)


def read_calls(emu: Any) -> int:
    """ReadRows calls the emulator has answered."""
    with open(emu.log_path, "rb") as log:
        return sum(b"BigQueryRead/ReadRows" in line for line in log)


def ids(ds: Dataset, limit: int | None = None) -> list[int]:
    out = []
    for record in ds:
        out.append(record["id"])
        if len(out) == limit:
            break
    return out


def test_open_dataset_plans_one_read_session_and_reads_every_row_once(emulator: Any) -> None:
    before = sessions(emulator)
    ds = open_dataset(TABLE, format=BigQuery(streams=3), shuffle=False, rank=0, world_size=1)
    ds.prepare()
    ds.prepare()
    assert sorted(ids(ds)) == list(range(ROWS))
    assert sorted(ids(ds)) == list(range(ROWS))  # the next epoch reads the same streams
    assert sessions(emulator) == before + 1


def test_plain_iteration_plans_lazily_once(emulator: Any) -> None:
    before = sessions(emulator)
    ds = open_dataset(TABLE, format=BigQuery(columns=["id"], streams=2), rank=0, world_size=1)
    first = ids(ds, 10)
    assert len(first) == 10 and sessions(emulator) == before + 1
    assert ds.state_dict()["fingerprint"] == ds.fingerprint()
    assert sessions(emulator) == before + 1


@pytest.mark.parametrize(("shuffle", "consumed"), [(False, 300), (True, 70_001)])
def test_resume_mid_epoch_reuses_the_saved_session_and_reads_every_row_once(
    emulator: Any, shuffle: bool, consumed: int, caplog
) -> None:
    def fresh() -> Dataset:  # table "resplit": every new session splits it into other streams
        return open_dataset(
            RESPLIT, format=BigQuery(streams=3), shuffle=shuffle, seed=5, rank=0, world_size=1
        )

    first = fresh()
    taken = ids(first, consumed)
    state = json.loads(json.dumps(first.state_dict()))
    assert state["session"]["name"] not in json.dumps(state["options"])
    before = sessions(emulator)
    again = fresh()
    again.load_state_dict(state)
    with caplog.at_level(logging.WARNING, logger="vertexrt.data"):
        rest = ids(again)
    assert sorted(taken + rest) == list(range(ROWS))  # every remaining row once, none of the taken ones
    assert sessions(emulator) == before  # the saved session's streams, not a new session
    assert "may repeat or be missed" not in caplog.text
    assert again.state_dict()["session"]["name"] == state["session"]["name"]


def test_a_dataloader_made_before_load_state_dict_reads_the_saved_session(emulator: Any) -> None:
    from vertexrt.data.torch import DataLoader

    def loader() -> DataLoader:
        fmt = BigQuery(streams=2)  # all columns: big enough for the emulator to grant 2 streams
        ds = open_dataset(RESPLIT, format=fmt, shuffle=False, equalize=None, rank=0, world_size=1)
        return DataLoader(ds, batch_size=1000, num_workers=2, multiprocessing_context="fork")

    first = loader()
    taken: list[int] = []
    for batch in first:
        taken += [int(i) for i in batch["id"]]
        if len(taken) >= 30_000:
            break
    state = json.loads(json.dumps(first.state_dict()))
    before = sessions(emulator)
    again = loader()  # plans a session of its own before the state is loaded
    again.load_state_dict(state)
    rest = [int(i) for batch in again for i in batch["id"]]
    assert sorted(taken + rest) == list(range(ROWS))
    assert sessions(emulator) == before + 1


def test_a_resume_keeps_the_saved_stream_counts_and_counts_nothing_again(emulator: Any) -> None:
    def fresh() -> Dataset:
        fmt = BigQuery(streams=3)
        return open_dataset(
            TABLE, format=fmt, shuffle=False, equalize="pad", batch_size=7, rank=0, world_size=1
        )

    first = fresh()
    first.prepare()
    taken = ids(first, 100)
    state = first.state_dict()
    assert sum(state["session"]["counts"]) == ROWS
    reads = read_calls(emulator)
    again = fresh()
    again.load_state_dict(state)
    again.prepare()
    assert read_calls(emulator) == reads  # the saved counts: no stream read to count them again
    rest = ids(again)
    assert len(taken) + len(rest) == -(-ROWS // 7) * 7 and set(taken + rest) == set(range(ROWS))


def test_the_emulator_splits_table_resplit_differently_in_each_session(emulator: Any) -> None:
    fmt = BigQuery(streams=3)
    counts = [fmt.count_streams(fmt.plan(parse_table(RESPLIT), 0, 1) or [], 0, 1) for _ in range(2)]
    assert len(counts[0]) == 3 and sum(counts[0]) == sum(counts[1]) == ROWS and counts[0] != counts[1]


def test_resume_after_the_saved_session_expired_opens_a_new_one_and_warns(emulator: Any, caplog) -> None:
    def fresh() -> Dataset:
        return open_dataset(RESPLIT, format=BigQuery(streams=3), shuffle=False, rank=0, world_size=1)

    first = fresh()
    taken = ids(first, 300)
    state = first.state_dict()
    state["session"]["expires"] = 0.0
    before = sessions(emulator)
    again = fresh()
    again.load_state_dict(state)
    with caplog.at_level(logging.WARNING, logger="vertexrt.data"):
        rest = ids(again)
    assert sessions(emulator) == before + 1 and len(taken) + len(rest) > 0
    assert "rows of this epoch may repeat or be missed" in caplog.text
    assert state["session"]["name"] in caplog.text


def test_a_malformed_saved_session_is_a_data_error_naming_it(emulator: Any) -> None:
    ds = open_dataset(TABLE, format=BigQuery(streams=2), shuffle=False, rank=0, world_size=1)
    ids(ds, 5)
    state = ds.state_dict()
    state["session"]["streams"] = "x" * 10
    again = open_dataset(TABLE, format=BigQuery(streams=2), shuffle=False, rank=0, world_size=1)
    with pytest.raises(DataError, match=r"session.*streams"):
        again.load_state_dict(state)


def test_fingerprint_has_columns_and_row_filter_not_the_session(emulator: Any) -> None:
    def fingerprint(**options: Any) -> str:
        ds = open_dataset(TABLE, format=BigQuery(**options), rank=0, world_size=1)
        ids(ds, 1)  # planned: its own read session
        return ds.fingerprint()

    before = sessions(emulator)
    same = fingerprint(columns=["id"])
    assert fingerprint(columns=["id"]) == same and sessions(emulator) == before + 2
    assert fingerprint(columns=["id", "name"]) != same
    assert fingerprint(columns=["id"], row_filter="id > 5") != same


def test_without_the_storage_api_open_dataset_reads_with_list_rows(emulator: Any, monkeypatch) -> None:
    from vertexrt._net import free_port

    before = sessions(emulator)
    monkeypatch.setenv("STORAGE_READ_EMULATOR_HOST", f"127.0.0.1:{free_port()}")  # nothing listens
    fmt = BigQuery(columns=["id"], timeout=2.0)
    ds = open_dataset(TABLE, format=fmt, shuffle=False, rank=0, world_size=1)
    assert ids(ds, 20) == list(range(20))  # row ranges of the table, in order
    assert sessions(emulator) == before


def test_count_of_a_table_is_its_metadata_no_session_and_no_stream_read(emulator: Any) -> None:
    before, reads = sessions(emulator), read_calls(emulator)
    ds = open_dataset(TABLE, format=BigQuery(streams=3), rank=0, world_size=1)
    assert ds.count() == ROWS  # no collective: safe on one rank of many
    assert sessions(emulator) == before and read_calls(emulator) == reads


@pytest.mark.parametrize("count_first", [True, False])
def test_table_count_and_stream_counts_do_not_mix(emulator: Any, count_first: bool) -> None:
    ds = open_dataset(TABLE, format=BigQuery(streams=3), equalize="pad", batch_size=7, rank=0, world_size=1)
    if count_first:
        assert ds.count() == ROWS
    ds.prepare()  # counts every stream for equalize
    assert ds.count() == ROWS
    assert ds.epoch_length() == -(-ROWS // 7) * 7  # this one reader's share: the whole table, padded


def test_count_with_a_row_filter_counts_the_filtered_rows(emulator: Any) -> None:
    fmt = BigQuery(columns=["id"], row_filter="id < 1000 AND score >= 10", streams=2)
    assert open_dataset(TABLE, format=fmt, rank=0, world_size=1).count() == 920


def test_an_expired_session_is_renewed_once_in_the_parent_not_in_each_dataloader_worker(
    emulator: Any, caplog
) -> None:
    from vertexrt.data.torch import DataLoader

    ds = open_dataset(TABLE, format=BigQuery(streams=2), shuffle=False, rank=0, world_size=1)  # 2 streams
    ds.prepare()
    ds._source.streams = [dataclasses.replace(s, expires=0.0) for s in ds._source.streams]  # 6 h later
    before = sessions(emulator)
    loader = DataLoader(ds, batch_size=4096, num_workers=2, multiprocessing_context="fork")
    got = [int(i) for batch in loader for i in batch["id"]]
    assert sorted(got) == list(range(ROWS))
    assert sessions(emulator) == before + 1  # one new session for the rank, none per worker
    ds._source.streams = [dataclasses.replace(s, expires=0.0) for s in ds._source.streams]
    loader.set_epoch(5)  # a new epoch renews it too
    assert sessions(emulator) == before + 2
    assert sorted(int(i) for batch in loader for i in batch["id"]) == list(range(ROWS))
    assert sessions(emulator) == before + 2


def test_the_next_epoch_of_a_plain_iteration_renews_an_expiring_session_once(emulator: Any, caplog) -> None:
    ds = open_dataset(TABLE, format=BigQuery(columns=["id"], streams=2), shuffle=False, rank=0, world_size=1)
    assert sorted(ids(ds)) == list(range(ROWS))  # epoch 0; the dataset moves on to epoch 1
    ds._source.streams = [dataclasses.replace(s, expires=0.0) for s in ds._source.streams]
    before = sessions(emulator)
    with caplog.at_level(logging.WARNING, logger="vertexrt.data"):
        assert sorted(ids(ds)) == list(range(ROWS))
    assert sessions(emulator) == before + 1 and "has expired" not in caplog.text


# -- two ranks -------------------------------------------------------------------------------------------
@exits_hard
def _rank(rank: int, port: int, out: str) -> None:
    import torch.distributed as dist

    from vertexrt.data.torch import DataLoader

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    ds = open_dataset(TABLE, format=BigQuery(streams=2), shuffle=False, equalize=None)
    # fork: workers of a spawned rank would be spawned too (seconds each to import torch again)
    loader = DataLoader(ds, batch_size=4096, num_workers=2, multiprocessing_context="fork")
    got = [int(i) for batch in loader for i in batch["id"]]
    Path(out, f"rank{rank}").write_text(" ".join(map(str, got)))
    equal = open_dataset(TABLE, format=BigQuery(streams=2), shuffle=False)  # "auto": drop_remainder
    loader = DataLoader(equal, batch_size=4096, num_workers=2, multiprocessing_context="fork")
    got = [int(i) for batch in loader for i in batch["id"]]
    Path(out, f"rank{rank}-equal").write_text(" ".join(map(str, got)))
    equal._source.streams = [dataclasses.replace(s, expires=0.0) for s in equal._source.streams]  # 6 h later
    loader.set_epoch(7)  # every rank: the chief makes one new session and shares it
    Path(out, f"rank{rank}-renewed").write_text(equal._source.streams[0].session)
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.slow
def test_two_ranks_share_one_session_and_read_every_row_once(
    bq_emulator: Callable[[bool], Any], monkeypatch, tmp_path: Path
) -> None:
    import torch.multiprocessing as mp

    emu = use(bq_emulator(True), monkeypatch)
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "CLUSTER_SPEC", "TF_CONFIG"):
        monkeypatch.delenv(name, raising=False)
    before, reads = sessions(emu), read_calls(emu)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(_rank, args=(port, str(tmp_path)), nprocs=2, start_method="spawn")

    def read(name: str) -> list[int]:
        return [int(i) for i in (tmp_path / name).read_text().split()]

    once = [read(f"rank{r}") for r in range(2)]
    assert all(once) and sorted(once[0] + once[1]) == list(range(ROWS))
    equal = [read(f"rank{r}-equal") for r in range(2)]
    assert len(equal[0]) == len(equal[1]) > 0 and len(set(equal[0] + equal[1])) == 2 * len(equal[0])
    renewed = {(tmp_path / f"rank{r}-renewed").read_text() for r in range(2)}
    assert len(renewed) == 1  # both ranks read the one session the chief renewed
    assert sessions(emu) == before + 3  # one per dataset, however many ranks and workers, + the renewal
    granted = len(create_session(parse_table(TABLE), 4))  # what the ranks' sessions were granted
    readers = 2 * 2
    assert granted >= readers  # each reader reads its own streams (else every reader reads them all)
    # each stream read once per dataset, plus once to count it for equalize (split between the ranks), and
    # the renewed session's streams counted once for equalize
    assert read_calls(emu) - reads == 4 * granted


# -- a stream that stops sending -------------------------------------------------------------------------
@pytest.fixture(scope="module")
def stalling(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """A bqemulator whose table ``stalled`` goes silent after one message, once per stream."""
    from bqemulator_launcher import BigQueryEmulator

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    python = os.environ.get("VERTEXRT_BQEMU_PYTHON") or os.path.join(root, ".venv", "bqemu", "bin", "python")
    if not os.path.exists(python):
        pytest.fail(f"no bqemulator venv at {python}: run `make install`")
    log = str(tmp_path_factory.mktemp("bq-stall") / "bqemulator.log")
    with BigQueryEmulator(python, log, honour_offset=True, stall_table="stalled") as emu:
        yield emu


def test_a_stalled_stream_is_cancelled_and_resumed_from_its_cursor(
    stalling: Any, monkeypatch, caplog
) -> None:
    use(stalling, monkeypatch, tables=("stalled",))
    fmt = BigQuery(columns=["id"], streams=1, timeout=3.0)  # idle timeout per message
    ds = open_dataset("bq://proj-1.ds.stalled", format=fmt, shuffle=False, rank=0, world_size=1)
    with caplog.at_level(logging.WARNING, logger="vertexrt.data.bigquery_storage"):
        got = ids(ds)
    assert got == list(range(ROWS))
    broke = r"stream broke at row [1-9][0-9]* \(.*no message for 3 s.*retrying from there"
    assert re.search(broke, caplog.text)


def test_storage_api_false_reads_with_list_rows_and_its_state_does_not_mix(emulator: Any) -> None:
    before = sessions(emulator)
    ds = open_dataset(TABLE, format=BigQuery(storage_api=False), shuffle=False, rank=0, world_size=1)
    assert ids(ds, 20) == list(range(20))
    assert sessions(emulator) == before
    storage = open_dataset(TABLE, format=BigQuery(), shuffle=False, rank=0, world_size=1)
    assert storage.fingerprint() != ds.fingerprint()  # a list_rows cursor is not a stream cursor
    with pytest.raises(DataError, match="row_filter='id > 3' needs the Storage Read API.*storage_api=False"):
        BigQuery(row_filter="id > 3", storage_api=False).plan(parse_table(TABLE), rank=0, world_size=1)


# -- readers and streams ---------------------------------------------------------------------------------
def read_offsets(emu: Any, since: int) -> list[int]:
    """The ``offset`` of each ReadRows request after the first ``since`` (the launcher logs them)."""
    with open(emu.log_path, "rb") as log:
        events = [json.loads(line) for line in log if b'"vertexrt.read_rows"' in line]
    return [int(event["offset"]) for event in events[since:]]


def test_equalize_with_dataloader_workers_drops_fewer_rows_than_readers(emulator: Any) -> None:
    from vertexrt.data.torch import DataLoader

    ds = open_dataset(
        TABLE, format=BigQuery(), shuffle=False, rank=0, world_size=1, equalize="drop_remainder"
    )
    loader = DataLoader(ds, batch_size=1000, num_workers=3, multiprocessing_context="fork")
    got = [int(i) for batch in loader for i in batch["id"]]
    assert len(got) == len(set(got)) > ROWS - 3  # each reader a contiguous third: at most 2 rows dropped


def test_the_session_asks_for_a_stream_per_reader(emulator: Any) -> None:
    from vertexrt.data.torch import DataLoader

    ds = open_dataset(TABLE, format=BigQuery(streams=1), shuffle=False, rank=0, world_size=1)
    DataLoader(ds, batch_size=1000, num_workers=3, multiprocessing_context="fork")
    assert len(ds._source.streams) == 3  # 1 per replica asked, but 3 readers read it


def test_a_stream_shared_by_several_readers_is_read_from_each_readers_row(emulator: Any) -> None:
    from vertexrt.clients import bigquery_client
    from vertexrt.data.torch import DataLoader

    bigquery_client("proj-1").query(
        "CREATE TABLE IF NOT EXISTS ds.small AS SELECT x AS id FROM UNNEST(GENERATE_ARRAY(0, 999)) AS x"
    ).result()
    ds = open_dataset("bq://proj-1.ds.small", format=BigQuery(), shuffle=False, rank=0, world_size=1)
    since = len(read_offsets(emulator, 0))
    loader = DataLoader(ds, batch_size=100, num_workers=4, multiprocessing_context="fork")
    got = [int(i) for batch in loader for i in batch["id"]]
    assert sorted(got) == list(range(1000))
    assert len(ds._source.streams) == 1  # the emulator grants one stream for a small table
    # one read to count the stream, then each of the 4 readers reads its quarter from its own row
    assert sorted(read_offsets(emulator, since)) == [0, 0, 250, 500, 750]


def test_list_rows_with_dataloader_workers_reads_every_row_once(emulator: Any) -> None:
    from vertexrt.data.torch import DataLoader

    fmt = BigQuery(storage_api=False, page_size=2000)  # many pages, read by 3 workers at once
    ds = open_dataset(TABLE, format=fmt, shuffle=False, rank=0, world_size=1, equalize=None)
    loader = DataLoader(ds, batch_size=1000, num_workers=3, multiprocessing_context="fork")
    assert sorted(int(i) for batch in loader for i in batch["id"]) == list(range(ROWS))


def read_sessions(emu: Any, since: int) -> set[str]:
    """The sessions of the ReadRows requests after the first ``since``."""
    with open(emu.log_path, "rb") as log:
        events = [json.loads(line) for line in log if b'"vertexrt.read_rows"' in line]
    return {event["stream"].split("/streams/")[0] for event in events[since:]}


def test_persistent_dataloader_workers_read_the_session_the_parent_renewed(emulator: Any) -> None:
    from vertexrt.data.torch import DataLoader

    ds = open_dataset(TABLE, format=BigQuery(columns=["id"], streams=2), shuffle=False, rank=0, world_size=1)
    loader = DataLoader(
        ds, batch_size=4096, num_workers=2, persistent_workers=True, multiprocessing_context="fork"
    )
    assert sorted(int(i) for batch in loader for i in batch["id"]) == list(range(ROWS))  # workers started
    ds._source.streams = [dataclasses.replace(s, expires=0.0) for s in ds._source.streams]  # 6 h later
    before = sessions(emulator)
    loader.set_epoch(5)  # the parent renews the session; the workers started with the old one
    renewed = ds._source.streams[0].session
    assert sessions(emulator) == before + 1
    since = len(read_offsets(emulator, 0))
    assert sorted(int(i) for batch in loader for i in batch["id"]) == list(range(ROWS))
    assert read_sessions(emulator, since) == {renewed}
    assert sessions(emulator) == before + 1

"""Counting records for ``equalize`` once per job: shared out between real gloo ranks (each counts about its
share of the bytes), all-gathered, and cached by the data's fingerprint so a restart does not count again.

Requests are counted by one :class:`FaultProxy` per rank in front of the Cloud Storage test server (each
rank's ``STORAGE_EMULATOR_HOST``); the files are listed here, so a rank's requests are its counting (and,
on rank 0, the count cache). Counts of requests and of counted files only: deterministic.
"""

from __future__ import annotations

import os
import socket
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from faultproxy import FaultProxy
from rank_exit import exits_hard

from vertexrt.data import Dataset
from vertexrt.data.formats.base import FileSource
from vertexrt.data.formats.jsonl import JSONL
from vertexrt.data.sources import expand_files

from .conftest import jsonl_bytes, write_bytes

SIZES = [30, 50, 20, 40, 60, 10, 25, 45]  # 8 files, 280 records


class CountingJSONL(JSONL):
    """JSONL that appends ``<pid> <uri>`` to a log file each time it counts a file (any process)."""

    def __init__(self, log: str):
        super().__init__()
        self.log = log

    def count(self, source: Any, errors: Any) -> int:
        with open(self.log, "a") as f:
            f.write(f"{os.getpid()} {source.uri}\n")
        return super().count(source, errors)

    def __repr__(self) -> str:  # the cache key holds the format: the log's path is no option of it
        return "CountingJSONL()"


def _write_files(root: str, sizes: list[int] = SIZES) -> list[FileSource]:
    next_id = 0
    for index, size in enumerate(sizes):
        write_bytes(f"{root}/part-{index:02d}.jsonl", jsonl_bytes({"id": next_id + i} for i in range(size)))
        next_id += size
    return expand_files(f"{root}/part-*.jsonl")


def _counted(log: str) -> list[tuple[str, str]]:
    if not os.path.exists(log):
        return []
    with open(log) as f:
        return [tuple(line.split(" ", 1)) for line in f.read().splitlines()]  # type: ignore[misc]


# -- one process ------------------------------------------------------------------------------------------
def test_a_restart_reads_the_counts_from_the_cache_and_a_changed_file_invalidates_them(
    tmp_path, monkeypatch
) -> None:
    monkeypatch.setenv("VERTEXRT_COUNT_CACHE", str(tmp_path / "cache"))
    log = str(tmp_path / "counts.log")
    files = _write_files(str(tmp_path / "data"))

    def length(sources: list[FileSource]) -> int | None:
        ds = Dataset(sources, CountingJSONL(log), rank=0, world_size=1, equalize="drop_remainder")
        return ds.epoch_length()

    assert length(files) == sum(SIZES)
    assert len(_counted(log)) == len(SIZES)  # every file counted once
    assert length(files) == sum(SIZES)  # a new process (a restart) over the same data
    assert len(_counted(log)) == len(SIZES)  # read from the cache: nothing counted again
    changed = tmp_path / "data" / "part-03.jsonl"
    changed.write_bytes(jsonl_bytes({"id": i} for i in range(41)))  # another size and version
    assert length(expand_files(str(tmp_path / "data" / "part-*.jsonl"))) == sum(SIZES) + 1
    assert len(_counted(log)) == 2 * len(SIZES)  # other data: counted afresh, not the stale counts


def test_a_damaged_cache_is_counted_again_not_trusted(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("VERTEXRT_COUNT_CACHE", str(tmp_path / "cache"))
    log = str(tmp_path / "counts.log")
    files = _write_files(str(tmp_path / "data"), [3, 4])
    ds = Dataset(files, CountingJSONL(log), rank=0, world_size=1, equalize="drop_remainder")
    assert ds.epoch_length() == 7
    (cache,) = (tmp_path / "cache").iterdir()
    cache.write_text(cache.read_text().replace("[0, 0, null, 3]", "[0, 0, null, -3]"))
    again = Dataset(files, CountingJSONL(log), rank=0, world_size=1, equalize="drop_remainder")
    assert again.epoch_length() == 7 and len(_counted(log)) == 4


def test_without_a_cache_directory_nothing_is_written(tmp_path, monkeypatch) -> None:
    monkeypatch.delenv("VERTEXRT_COUNT_CACHE", raising=False)
    monkeypatch.delenv("AIP_CHECKPOINT_DIR", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    files = _write_files(str(tmp_path / "data"), [3, 4])
    ds = Dataset(files, JSONL(), rank=0, world_size=1, equalize="drop_remainder")
    assert ds.epoch_length() == 7
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data"]


def test_the_cache_lives_beside_the_checkpoints_on_vertex(tmp_path, monkeypatch) -> None:
    monkeypatch.delenv("VERTEXRT_COUNT_CACHE", raising=False)
    monkeypatch.setenv("AIP_CHECKPOINT_DIR", str(tmp_path / "checkpoints"))
    files = _write_files(str(tmp_path / "data"), [3, 4])
    Dataset(files, JSONL(), rank=0, world_size=1, equalize="drop_remainder").epoch_length()
    assert len(list((tmp_path / "checkpoints" / "vertexrt-data-counts").iterdir())) == 1


# -- real gloo ranks through counting proxies ----------------------------------------------------------
@exits_hard
def _prepare_rank(
    rank: int, world: int, port: int, endpoints: list[str], files: list[FileSource], out: str
) -> None:
    import datetime

    os.environ["STORAGE_EMULATOR_HOST"] = endpoints[rank]  # this rank's proxy counts its requests
    import torch.distributed as dist

    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=60),
    )
    try:
        ds = Dataset(files, CountingJSONL(f"{out}/counts.log"), equalize="drop_remainder")
        ds.prepare()  # every rank at the same point: counts for equalize
        Path(out, f"rank{rank}").write_text(str(ds.epoch_length()))
    finally:
        dist.destroy_process_group()


def _run_ranks(world: int, files: list[FileSource], out: Path, upstream: int) -> list[int]:
    """Each rank prepares the dataset through its own proxy; its requests, by rank."""
    import torch.multiprocessing as mp

    out.mkdir(exist_ok=True)
    proxies = [FaultProxy(("127.0.0.1", upstream)).start() for _ in range(world)]
    try:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        endpoints = [p.endpoint for p in proxies]
        mp.start_processes(
            _prepare_rank, args=(world, port, endpoints, files, str(out)), nprocs=world, start_method="spawn"
        )
        lengths = {Path(out, f"rank{r}").read_text() for r in range(world)}
        assert lengths == {str(sum(SIZES) // world)}, lengths  # the same equal share on every rank
        return [sum(p.handled.values()) for p in proxies]
    finally:
        for proxy in proxies:
            proxy.stop()


def _bytes_by_rank(log: str, files: list[FileSource]) -> list[int]:
    """Bytes of the files each process counted, one entry per process."""
    size = {f.uri: f.size for f in files}
    by_pid: Counter[str] = Counter()
    for pid, uri in _counted(log):
        by_pid[pid] += size[uri]
    return list(by_pid.values())


@pytest.mark.slow
def test_counting_is_shared_between_ranks_and_its_requests_do_not_grow_with_them(
    tmp_path, gcs_server, monkeypatch
) -> None:
    monkeypatch.setenv("VERTEXRT_COUNT_CACHE", "off")
    files = _write_files(f"gs://{gcs_server.bucket}/{uuid.uuid4().hex}")  # type: ignore[attr-defined]
    total = sum(f.size for f in files)
    requests = {}
    for world in (2, 4):
        out = tmp_path / f"world{world}"
        requests[world] = _run_ranks(world, files, out, gcs_server.port)
        counted = _counted(str(out / "counts.log"))
        assert Counter(uri for _, uri in counted) == Counter(f.uri for f in files)  # each file once
        largest = max(f.size for f in files)
        assert max(_bytes_by_rank(str(out / "counts.log"), files)) <= total / world + largest
    # the job reads each file once, however many ranks: one request (opened with its listed size)
    assert sum(requests[4]) == sum(requests[2]) == len(files)
    assert max(requests[4]) < max(requests[2])  # and each rank's share shrinks


@pytest.mark.slow
def test_a_restarted_job_reads_the_cached_counts_on_rank_0_only_and_counts_nothing(
    tmp_path, gcs_server, monkeypatch
) -> None:
    root = f"gs://{gcs_server.bucket}/{uuid.uuid4().hex}"  # type: ignore[attr-defined]
    monkeypatch.setenv("VERTEXRT_COUNT_CACHE", f"{root}/counts")
    files = _write_files(f"{root}/data")
    _run_ranks(2, files, tmp_path / "first", gcs_server.port)
    assert len(_counted(str(tmp_path / "first" / "counts.log"))) == len(files)
    again = _run_ranks(2, files, tmp_path / "restart", gcs_server.port)
    assert _counted(str(tmp_path / "restart" / "counts.log")) == []  # nothing counted again
    assert again == [1, 0]  # rank 0 read the cache (one request); rank 1 asked storage nothing
    write_bytes(files[2].uri, jsonl_bytes({"id": i} for i in range(10, 30)))  # same size, new content
    changed = expand_files(f"{root}/data/part-*.jsonl")
    assert [f.size for f in changed] == [f.size for f in files] and changed != files
    _run_ranks(2, changed, tmp_path / "changed", gcs_server.port)
    assert len(_counted(str(tmp_path / "changed" / "counts.log"))) == len(files)  # counted afresh

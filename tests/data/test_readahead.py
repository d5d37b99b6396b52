"""Cloud Storage reads fetch the next ranges ahead of the parser: the same records in the same order, exact
resume, a failed fetch raised as the typed error by the read that needs it, nothing left running after
close, and one request per range (no metadata request: the listing gave the size)."""

from __future__ import annotations

import asyncio
import math
import random
import threading
import time
import uuid
from typing import Any

import orjson
import pytest

from vertexrt import paths
from vertexrt.data import JSONL, TFRecord, _ranged, open_dataset
from vertexrt.data._io import open_at
from vertexrt.data.formats.base import Errors, FileSource
from vertexrt.data.formats.tfrecord import encode_record
from vertexrt.errors import DataError

from .conftest import assert_resumes_exactly, read_all, write_bytes

RANGE = 50_021  # small, odd ranges: a file of a few hundred KiB spans many, and records cross them


@pytest.fixture
def small_ranges(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_ranged, "RANGE_SIZE", RANGE)


def tfrecord_bytes(seed: int = 7) -> bytes:
    rng = random.Random(seed)  # payloads shorter than a range, and longer than several
    sizes = [rng.choice((0, 1, 100, 4_000, 49_990, 50_021, 120_000)) for _ in range(30)]
    return b"".join(encode_record(rng.randbytes(n)) for n in sizes)


def jsonl_bytes(seed: int = 7) -> bytes:
    rng = random.Random(seed)
    return b"".join(orjson.dumps({"id": i, "pad": "x" * rng.randrange(0, 9_000)}) + b"\n" for i in range(300))


def on_gcs(gcs_server: Any, name: str, data: bytes) -> str:
    return write_bytes(f"gs://{gcs_server.bucket}/{uuid.uuid4().hex}/{name}", data)


@pytest.mark.parametrize("name, make", [("a.tfrecord", tfrecord_bytes), ("a.jsonl", jsonl_bytes)])
@pytest.mark.parametrize("world_size", [1, 3])
def test_records_are_those_of_the_local_file_in_order(
    small_ranges: None, gcs_server: Any, tmp_path: Any, name: str, make: Any, world_size: int
) -> None:
    data = make()
    assert len(data) > 8 * RANGE
    local = tmp_path / name
    local.write_bytes(data)
    uri = on_gcs(gcs_server, name, data)
    for rank in range(world_size):  # with 3 readers the file is read in byte pieces
        options = {"rank": rank, "world_size": world_size, "equalize": None}
        expected = read_all(str(local), **options)
        assert expected and read_all(uri, **options) == expected


@pytest.mark.parametrize("name, make", [("a.tfrecord", tfrecord_bytes), ("a.jsonl", jsonl_bytes)])
def test_resume_mid_file_is_exact(small_ranges: None, gcs_server: Any, name: str, make: Any) -> None:
    uri = on_gcs(gcs_server, name, make())
    records = len(read_all(uri))
    assert_resumes_exactly(uri, (1, records // 3, records - 1))


@pytest.mark.timeout(60)
def test_a_fetch_that_fails_ahead_is_raised_as_the_typed_error_naming_the_file(
    small_ranges: None, gcs_server: Any, fault_proxy: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    data = tfrecord_bytes()
    uri = on_gcs(gcs_server, "a.tfrecord", data)
    full = read_all(uri)
    monkeypatch.setenv("VERTEXRT_STORAGE_TIMEOUT", "1")
    fault_proxy.set("stall", match=rf"(?i)range: bytes={3 * RANGE}-")  # the fourth range never comes
    got: list[Any] = []
    with pytest.raises(DataError, match=r"no usable answer within 1 s while reading " + uri):
        for record in open_dataset(uri, shuffle=False, rank=0, world_size=1):
            got.append(record)
    assert got == full[: len(got)]
    assert fault_proxy.handled["stall"] == 1


def tasks_on(loop: Any) -> int:
    """The asyncio tasks on ``loop`` (gcsfs's event loop), this count's own excluded."""

    async def count() -> int:
        return len(asyncio.all_tasks()) - 1

    return asyncio.run_coroutine_threadsafe(count(), loop).result(30)


def requests_arrive(proxy: Any, mode: str, count: int) -> None:
    """Wait until ``proxy`` has had exactly ``count`` requests in ``mode``: they are sent by gcsfs's I/O
    thread, and the proxy offers no event to wait on (bounded: fails after 30 s)."""
    deadline = time.monotonic() + 30
    while proxy.handled[mode] < count:
        assert time.monotonic() < deadline, f"requests seen: {dict(proxy.handled)}"
        time.sleep(0.01)
    assert proxy.handled[mode] == count


@pytest.mark.timeout(60)
def test_close_ends_the_fetches_in_flight(
    small_ranges: None, gcs_server: Any, fault_proxy: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    data = tfrecord_bytes()
    uri = on_gcs(gcs_server, "a.tfrecord", data)
    monkeypatch.setenv("VERTEXRT_STORAGE_TIMEOUT", "600")  # a stalled fetch would outlast the test
    fs, _ = paths.filesystem(uri)
    idle = tasks_on(fs.loop)
    fault_proxy.set("stall", match=r"(?i)range: bytes=(?!0-)")  # every range after the first: no answer
    f = open_at(uri, "", 0, size=len(data))
    requests_arrive(fault_proxy, "stall", _ranged.READ_AHEAD)  # the next ranges are asked for unread
    assert f.read(RANGE) == data[:RANGE]
    f.close()  # returns at once: the stalled fetches ahead are cancelled
    assert tasks_on(fs.loop) == idle
    with pytest.raises(DataError, match="read after close"):
        f.read(1)


@pytest.mark.parametrize("fmt, make", [(TFRecord(), tfrecord_bytes), (JSONL(), jsonl_bytes)])
def test_a_file_costs_one_request_per_range_and_no_metadata_request(
    small_ranges: None, gcs_server: Any, fault_proxy: Any, fmt: Any, make: Any
) -> None:
    data = make()
    uri = on_gcs(gcs_server, f"a.{fmt.name}", data)
    # the format reads the file as the dataset does, with the size its listing gave; counted alone (a
    # listing's own probes may still be arriving when it returns)
    before = fault_proxy.handled["pass"]
    chunks = list(fmt.read(FileSource(uri, len(data)), 0, None, Errors()))
    requests = fault_proxy.handled["pass"] - before
    assert requests == math.ceil(len(data) / RANGE)  # one per range, and no metadata request
    assert sum(len(raws) for _, raws in chunks) == len(read_all(uri))


def test_leaving_the_loop_early_leaves_no_thread_and_no_fetch(small_ranges: None, gcs_server: Any) -> None:
    uri = on_gcs(gcs_server, "a.tfrecord", tfrecord_bytes())
    fs, _ = paths.filesystem(uri)
    ds = open_dataset(uri, shuffle=False, rank=0, world_size=1, prefetch=2)
    threads, idle = threading.active_count(), tasks_on(fs.loop)
    for index, _ in enumerate(ds):
        if index == 2:
            break  # the prefetch thread is reading ahead, its file fetching ranges ahead
    assert threading.active_count() == threads
    assert tasks_on(fs.loop) == idle

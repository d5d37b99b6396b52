"""The background reader thread: bounded, stoppable, and its errors reach the iterating thread."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest

from vertexrt.data import Prefetcher, open_dataset
from vertexrt.errors import DataError


def test_items_in_order_and_bounded_read_ahead() -> None:
    produced = []

    def make() -> Iterator[int]:
        for i in range(100):
            produced.append(i)
            yield i

    with Prefetcher(make, depth=3) as items:
        first = next(items)
        deadline = time.monotonic() + 5
        while len(produced) < 5 and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.1)
        assert first == 0 and len(produced) <= 1 + 3 + 1  # consumed + queued + one blocked in put
        assert [first, *items] == list(range(100))


def test_error_in_the_thread_is_raised_by_next() -> None:
    def make() -> Iterator[int]:
        yield 1
        raise DataError("gs://b/x: boom at byte 7")

    items = Prefetcher(make, depth=2)
    assert next(items) == 1
    with pytest.raises(DataError, match="boom at byte 7"):
        next(items)
    with pytest.raises(StopIteration):
        next(items)


def test_close_stops_a_blocked_producer() -> None:
    def make() -> Iterator[int]:
        i = 0
        while True:
            yield i
            i += 1

    before = threading.active_count()
    items = Prefetcher(make, depth=1)
    next(items)
    items.close()
    assert threading.active_count() <= before


def test_dataset_errors_from_the_reader_thread_reach_the_loop(tmp_path) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_bytes(b'{"a": 1}\n' * 5 + b"{oops\n")
    ds = open_dataset(str(path), shuffle=False, prefetch=2, rank=0, world_size=1)
    got = []
    with pytest.raises(DataError, match=r"bad.jsonl:6 \(byte 45\): malformed JSON"):
        for record in ds:
            got.append(record)
    assert got == []  # the bad line is in the first chunk: nothing from it is handed out


def test_breaking_out_of_the_loop_stops_the_reader_thread(tmp_path, write_jsonl) -> None:
    write_jsonl(str(tmp_path / "a.jsonl"), [{"i": i} for i in range(100_000)])
    before = threading.active_count()
    ds = open_dataset(str(tmp_path / "a.jsonl"), shuffle=False, rank=0, world_size=1)
    for record in ds:
        if record["i"] == 10:
            break
    del record
    deadline = time.monotonic() + 5
    import gc

    gc.collect()
    while threading.active_count() > before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert threading.active_count() <= before
    assert ds.state_dict()["cursors"]["0"]["skip"] == 11

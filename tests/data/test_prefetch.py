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
    from vertexrt.data import TFRecordWriter

    path = str(tmp_path / "bad.tfrecord")
    with TFRecordWriter(path) as writer:
        for i in range(5):
            writer.write(b"r%d" % i)
    with open(path, "ab") as f:
        f.write(b"\x05\x00\x00")  # a torn header, detected by the reader thread
    ds = open_dataset(path, shuffle=False, prefetch=2, rank=0, world_size=1)
    got = []
    with pytest.raises(DataError, match=r"bad\.tfrecord: truncated record at byte 90"):
        for record in ds:
            got.append(record)
    assert got == [b"r0", b"r1", b"r2", b"r3", b"r4"]  # everything before the damage was delivered


def test_decode_errors_keep_earlier_records_and_positions(tmp_path) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_bytes(b'{"a": 1}\n' * 5 + b"{oops\n" + b'{"a": 2}\n')
    ds = open_dataset(str(path), shuffle=False, rank=0, world_size=1)
    got = []
    with pytest.raises(DataError, match=r"bad.jsonl:6 \(byte 45\): malformed JSON"):
        for record in ds:
            got.append(record)
    assert got == [{"a": 1}] * 5
    skipping = open_dataset(str(path), shuffle=False, rank=0, world_size=1, on_error="skip")
    it = iter(skipping)
    assert [next(it) for _ in range(6)] == [{"a": 1}] * 5 + [{"a": 2}]
    assert skipping.state_dict()["cursors"]["0"]["skip"] == 7 and skipping.skipped == 1


def test_breaking_out_of_the_loop_stops_the_reader_thread(tmp_path, write_jsonl) -> None:
    write_jsonl(str(tmp_path / "a.jsonl"), [{"i": i} for i in range(100_000)])
    before = threading.active_count()
    ds = open_dataset(str(tmp_path / "a.jsonl"), shuffle=False, prefetch=2, rank=0, world_size=1)
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

"""vertexrt.tensorboard_events: the records TensorBoard's own protobuf encoding gives, CRCs it accepts."""

from __future__ import annotations

import math
import os
import threading

import pytest

from vertexrt.tensorboard_events import FILE_VERSION, ScalarEventWriter

pytest.importorskip("tensorboard")
from tensorboard.backend.event_processing.event_file_loader import (  # noqa: E402
    EventFileLoader,
    RawEventFileLoader,
)
from tensorboard.compat.proto import event_pb2, summary_pb2  # noqa: E402

CASES = [  # (tag, value, step): negative and 64-bit steps, non-ASCII tags, float32 edge values
    ("loss", 0.25, 1),
    ("train/ünïcode ✓", -3.5, 2**40),
    ("neg", 1.0, -7),
    ("big", 1e40, 3),
    ("nan", math.nan, 4),
    ("tiny", 1e-50, 5),
    ("a" * 200, 7.0, 0),
]


def test_each_record_is_the_event_tensorboard_would_encode(tmp_path) -> None:
    with ScalarEventWriter(str(tmp_path)) as events:
        for tag, value, step in CASES:
            events.add_scalar(tag, value, step)
    [name] = os.listdir(tmp_path)
    assert name.startswith("events.out.tfevents.") and f".{os.getpid()}." in name  # TensorBoard's naming
    raw = list(RawEventFileLoader(events.path).Load())  # a record with a wrong CRC would be left out
    parsed = [event_pb2.Event.FromString(data) for data in raw]
    assert parsed[0].file_version == FILE_VERSION.decode()
    assert (
        raw[0]
        == event_pb2.Event(wall_time=parsed[0].wall_time, file_version="brain.Event:2").SerializeToString()
    )
    for data, event, (tag, value, step) in zip(raw[1:], parsed[1:], CASES, strict=True):
        summary = summary_pb2.Summary(value=[summary_pb2.Summary.Value(tag=tag, simple_value=value)])
        expected = event_pb2.Event(wall_time=event.wall_time, step=step, summary=summary)
        assert data == expected.SerializeToString()  # byte for byte, NaN and overflow to inf included


def test_scalars_from_several_threads_are_whole_records(tmp_path) -> None:
    """The gs:// upload thread flushes while the loop writes: every record stays whole."""
    events = ScalarEventWriter(str(tmp_path))
    threads = [
        threading.Thread(target=lambda n=n: [events.add_scalar(f"t{n}", i, i) for i in range(200)])
        for n in range(4)
    ]
    for thread in threads:
        thread.start()
    for _ in range(50):
        events.flush()
    for thread in threads:
        thread.join()
    events.close()
    events.flush()  # after close: nothing to do
    steps = [e.step for e in EventFileLoader(events.path).Load() if e.HasField("summary")]
    assert sorted(steps) == sorted(list(range(200)) * 4)

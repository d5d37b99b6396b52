"""Property tests: exactly once for any file sizes and topology; resume anywhere gives the same stream."""

from __future__ import annotations

import json
import os
import tempfile
from collections import Counter

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from vertexrt.data import open_dataset

from .conftest import jsonl_bytes

SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def write_files(root: str, sizes: list[int]) -> str:
    first = 0
    for index, size in enumerate(sizes):
        with open(os.path.join(root, f"p{index:02d}.jsonl"), "wb") as f:
            f.write(jsonl_bytes({"id": first + i} for i in range(size)))
        first += size
    return os.path.join(root, "p*.jsonl")


@SETTINGS
@given(
    sizes=st.lists(st.integers(0, 40), min_size=1, max_size=8).filter(lambda s: sum(s) > 0),
    world=st.integers(1, 4),
    workers=st.integers(1, 3),
    shuffle=st.booleans(),
    buffer=st.integers(1, 20),
    epoch=st.integers(0, 3),
)
def test_every_record_exactly_once(
    sizes: list[int], world: int, workers: int, shuffle: bool, buffer: int, epoch: int
) -> None:
    with tempfile.TemporaryDirectory() as root:
        pattern = write_files(root, sizes)
        seen: Counter[int] = Counter()
        for rank in range(world):
            for worker in range(workers):
                ds = open_dataset(
                    pattern, rank=rank, world_size=world, shuffle=shuffle, shuffle_buffer=buffer
                )
                ds._worker = (worker, workers)
                ds.set_epoch(epoch)
                seen.update(r["id"] for r in ds)
        assert seen == Counter(range(sum(sizes)))


@SETTINGS
@given(
    sizes=st.lists(st.integers(0, 40), min_size=1, max_size=6).filter(lambda s: sum(s) > 0),
    world=st.integers(1, 3),
    equalize=st.sampled_from([None, "drop_remainder", "pad"]),
    buffer=st.integers(1, 16),
    data=st.data(),
)
def test_resume_anywhere_continues_the_stream(
    sizes: list[int], world: int, equalize: str | None, buffer: int, data: st.DataObject
) -> None:
    with tempfile.TemporaryDirectory() as root:
        pattern = write_files(root, sizes)
        rank = data.draw(st.integers(0, world - 1))
        options = {
            "rank": rank,
            "world_size": world,
            "seed": 3,
            "shuffle_buffer": buffer,
            "equalize": equalize,
        }
        full = [r["id"] for r in open_dataset(pattern, **options)]  # type: ignore[arg-type]
        stop = data.draw(st.integers(0, len(full)))
        ds = open_dataset(pattern, **options)  # type: ignore[arg-type]
        it = iter(ds)
        head = [next(it)["id"] for _ in range(stop)]
        state = json.loads(json.dumps(ds.state_dict()))
        again = open_dataset(pattern, **options)  # type: ignore[arg-type]
        again.load_state_dict(state)
        assert head + [r["id"] for r in again] == full

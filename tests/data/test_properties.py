"""Property tests: exactly once for any file sizes and topology; resume anywhere gives the same stream."""

from __future__ import annotations

import json
import os
import tempfile
from collections import Counter
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from vertexrt.data import CSV, JSONL, open_dataset

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
                    pattern,
                    rank=rank,
                    world_size=world,
                    shuffle=shuffle,
                    shuffle_buffer=buffer,
                    equalize=None,
                )
                ds.set_loader_worker(worker, workers)
                ds.set_epoch(epoch)
                seen.update(r["id"] for r in ds)
        assert seen == Counter(range(sum(sizes)))


@SETTINGS
@given(
    sizes=st.lists(st.integers(0, 40), min_size=1, max_size=6).filter(lambda s: sum(s) > 0),
    world=st.integers(1, 3),
    equalize=st.sampled_from([None, "auto", "drop_remainder", "pad"]),
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


@SETTINGS
@given(
    body=st.text(alphabet='ab,"\n\xe9', min_size=1, max_size=400),
    csv=st.booleans(),
    limit=st.integers(4, 40),
    data=st.data(),
)
def test_damaged_text_resumes_anywhere(body: str, csv: bool, limit: int, data: st.DataObject) -> None:
    """Stray quotes, overlong records and undecodable bytes, read in tiny reads (max_record_bytes): the
    records skipped and kept do not depend on where a read begins, so resume stays exact."""
    with tempfile.TemporaryDirectory() as root:
        path = os.path.join(root, "d.csv" if csv else "d.jsonl")
        with open(path, "wb") as f:
            f.write(b"a,b\n" + body.encode("latin-1") if csv else body.encode("latin-1"))
        fmt = CSV(max_record_bytes=limit) if csv else JSONL(max_record_bytes=limit)
        options = {"shuffle": False, "rank": 0, "world_size": 1, "on_error": "skip"}
        full = list(open_dataset(path, fmt, **options))  # type: ignore[arg-type]
        stop = data.draw(st.integers(0, len(full)))
        ds = open_dataset(path, fmt, **options)  # type: ignore[arg-type]
        it = iter(ds)
        head = [next(it) for _ in range(stop)]
        again = open_dataset(path, fmt, **options)  # type: ignore[arg-type]
        again.load_state_dict(json.loads(json.dumps(ds.state_dict())))
        assert head + list(again) == full


@SETTINGS
@given(
    sizes=st.lists(st.integers(0, 40), min_size=1, max_size=6).filter(lambda s: sum(s) > 0),
    old=st.tuples(st.integers(2, 3), st.integers(1, 2)),
    new=st.tuples(st.integers(1, 3), st.integers(1, 2)),
    shuffle=st.booleans(),
    data=st.data(),
)
def test_resume_on_another_topology_reads_nothing_twice(
    sizes: list[int], old: tuple[int, int], new: tuple[int, int], shuffle: bool, data: st.DataObject
) -> None:
    """Readers of an ``old`` (world, workers) job stop anywhere; a ``new`` one resumes from the merged state:
    no record twice, and only the ``drop_remainder`` tail (under one record per new reader) unread."""
    from vertexrt.data import merge_states

    with tempfile.TemporaryDirectory() as root:
        pattern = write_files(root, sizes)
        options = {"seed": 3, "shuffle": shuffle, "shuffle_buffer": 1, "equalize": "drop_remainder"}

        def reader(rank: int, world: int, worker: int, workers: int) -> Any:
            ds = open_dataset(pattern, rank=rank, world_size=world, **options)  # type: ignore[arg-type]
            ds.set_loader_worker(worker, workers)
            return ds

        seen: Counter[int] = Counter()
        states = []
        for rank in range(old[0]):
            for worker in range(old[1]):
                ds = reader(rank, old[0], worker, old[1])
                share = len(list(reader(rank, old[0], worker, old[1])))
                it = iter(ds)
                seen.update(next(it)["id"] for _ in range(data.draw(st.integers(0, share))))
                states.append(json.loads(json.dumps(ds.state_dict())))
        state = merge_states(states)
        for rank in range(new[0]):
            for worker in range(new[1]):
                ds = reader(rank, new[0], worker, new[1])
                ds.load_state_dict(state)
                seen.update(r["id"] for r in ds)
        assert max(seen.values(), default=1) == 1
        assert sum(sizes) - len(seen) < new[0] * new[1] + old[0] * old[1]

"""Resume mid-epoch on another topology (world size x DataLoader workers): each record still read once."""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest

from vertexrt.data import merge_states, open_dataset
from vertexrt.data.sharding import remaining, share
from vertexrt.errors import DataError

from .conftest import SIZES_7

TOTAL = sum(SIZES_7)  # 216: divisible by 4, 3 and 1


def reader(root: str, rank: int, world: int, worker: int, workers: int, **kw: Any) -> Any:
    options: dict[str, Any] = {"seed": 5, "shuffle_buffer": 1, **kw}
    ds = open_dataset(f"{root}/part-*.jsonl", rank=rank, world_size=world, **options)
    ds.set_loader_worker(worker, workers)  # what get_worker_info() reports inside a DataLoader worker
    ds.set_epoch(2)
    return ds


def run_2x2_then(root: str, stops: list[int], world: int, workers: int) -> Counter[int]:
    """Readers of a 2 x 2 job read ``stops`` records each and save; a ``world`` x ``workers`` job resumes."""
    seen: Counter[int] = Counter()
    states = []
    for rank in range(2):
        rank_state: list[dict[str, Any]] = []
        for worker in range(2):
            ds = reader(root, rank, 2, worker, 2)
            it = iter(ds)
            seen.update(next(it)["id"] for _ in range(stops[rank * 2 + worker]))
            rank_state.append(json.loads(json.dumps(ds.state_dict())))
        states.append(merge_states(rank_state))  # what one rank's DataLoader.state_dict() holds
    state = merge_states(states)
    for rank in range(world):
        for worker in range(workers):
            ds = reader(root, rank, world, worker, workers)
            ds.load_state_dict(state)
            ds.set_epoch(2)
            seen.update(r["id"] for r in ds)
    return seen


@pytest.mark.parametrize(("world", "workers"), [(3, 1), (1, 1), (1, 3)])
def test_2x2_readers_resume_mid_epoch_on_another_topology_exactly_once(
    tmp_path, id_files: Callable[..., list[str]], world: int, workers: int
) -> None:
    id_files(str(tmp_path))
    seen = run_2x2_then(str(tmp_path), [10, 20, 5, 10], world, workers)  # 171 left: 57 per reader of 3
    assert seen == Counter(range(TOTAL))


def test_resumed_state_moves_again(tmp_path, id_files: Callable[..., list[str]]) -> None:
    """2 readers -> 3 readers (save mid-way) -> 1 reader: still every record once."""
    id_files(str(tmp_path))
    root = str(tmp_path)
    seen: Counter[int] = Counter()
    states = []
    for rank, stop in ((0, 30), (1, 3)):
        ds = reader(root, rank, 2, 0, 1)
        it = iter(ds)
        seen.update(next(it)["id"] for _ in range(stop))
        states.append(ds.state_dict())
    middle = []
    for rank, stop in ((0, 7), (1, 0), (2, 60)):
        ds = reader(root, rank, 3, 0, 1)
        ds.load_state_dict(merge_states(states))
        it = iter(ds)
        seen.update(next(it)["id"] for _ in range(stop))
        middle.append(json.loads(json.dumps(ds.state_dict())))
    last = reader(root, 0, 1, 0, 1)
    last.load_state_dict(merge_states(middle))
    seen.update(r["id"] for r in last)
    assert seen == Counter(range(TOTAL))
    assert len(json.dumps(merge_states(middle))) < 2000  # O(readers), never O(records)


def test_shuffle_buffer_state_names_both_world_sizes(tmp_path, id_files: Callable[..., list[str]]) -> None:
    id_files(str(tmp_path))
    states = []
    for rank in range(2):
        ds = reader(str(tmp_path), rank, 2, 0, 1, shuffle_buffer=8)
        next(iter(ds))
        states.append(ds.state_dict())
    moved = reader(str(tmp_path), 0, 3, 0, 1, shuffle_buffer=8)
    moved.load_state_dict(merge_states(states))
    with pytest.raises(DataError, match=r"world_size=2 x 1 .*world_size=3 x 1.*shuffle_buffer=1"):
        next(iter(moved))


def test_one_ranks_state_cannot_move(tmp_path, id_files: Callable[..., list[str]]) -> None:
    id_files(str(tmp_path))
    ds = reader(str(tmp_path), 1, 2, 0, 1)
    next(iter(ds))
    moved = reader(str(tmp_path), 0, 1, 0, 1)
    moved.load_state_dict(ds.state_dict())
    with pytest.raises(DataError, match=r"readers \[1\] only \(missing \[0\]\).*merge_states"):
        next(iter(moved))


def test_same_topology_resume_is_unchanged(tmp_path, id_files: Callable[..., list[str]]) -> None:
    id_files(str(tmp_path))
    ds = reader(str(tmp_path), 1, 2, 0, 1)
    it = iter(ds)
    head = [next(it)["id"] for _ in range(9)]
    again = reader(str(tmp_path), 1, 2, 0, 1)
    again.load_state_dict(ds.state_dict())
    again.set_epoch(2)
    assert head + [r["id"] for r in again] == [r["id"] for r in reader(str(tmp_path), 1, 2, 0, 1)]


def test_plan_helpers() -> None:
    assert share([(0, 10)], 1, 3) == [(3, 6)]
    assert remaining([(0, 10)], 2, {0: 5, 1: 1}) == [(6, 10)]
    assert remaining([(0, 4), (6, 10)], 2, {}) == [(0, 4), (6, 10)]
    assert remaining([(0, 4), (6, 10)], 2, {0: 1}) == [(1, 4), (6, 10)]


@pytest.mark.slow
def test_dataloader_workers_2x2_resume_as_3x1(tmp_path, id_files: Callable[..., list[str]]) -> None:
    """Real DataLoader worker processes: two ranks of 2 workers save, three ranks of 1 worker resume."""
    pytest.importorskip("torch")
    from vertexrt.data import DataLoader

    id_files(str(tmp_path))
    root = str(tmp_path)

    def loader(rank: int, world: int, workers: int) -> Any:
        ds = open_dataset(f"{root}/part-*.jsonl", rank=rank, world_size=world, seed=5, shuffle_buffer=1)
        return DataLoader(ds, batch_size=3, num_workers=workers, multiprocessing_context="fork")

    seen: Counter[int] = Counter()
    states = []
    for rank, batches in ((0, 5), (1, 2)):
        first = loader(rank, 2, 2)
        it = iter(first)
        for _ in range(batches):
            seen.update(int(i) for i in next(it)["id"])
        states.append(json.loads(json.dumps(first.state_dict())))
        del it
    state = merge_states(states)
    for rank in range(3):
        again = loader(rank, 3, 1)
        again.load_state_dict(state)
        seen.update(int(i) for batch in again for i in batch["id"])
    assert max(seen.values()) == 1  # nothing twice
    assert TOTAL - len(seen) < 3 * 3  # drop_remainder: under readers x batch_size records go unread

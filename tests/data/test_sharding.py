"""Exactly-once sharding over replicas x DataLoader workers, and equal counts with equalize=."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

import pytest

from vertexrt.data import open_dataset
from vertexrt.data.dataset import Dataset
from vertexrt.data.sharding import Topology, Unit, assign, epoch_order, reader_counts
from vertexrt.errors import ConfigError

from .conftest import SIZES_7

TOTAL = sum(SIZES_7)


def reader_ids(ds: Dataset, rank: int, worker: int, workers: int) -> list[int]:
    ds.set_loader_worker(worker, workers)  # what get_worker_info() reports inside a DataLoader worker
    return [r["id"] for r in ds]


def all_readers(root: str, world: int, workers: int, **kw: object) -> dict[tuple[int, int], list[int]]:
    out = {}
    for rank in range(world):
        for worker in range(workers):
            ds = open_dataset(f"{root}/part-*.jsonl", rank=rank, world_size=world, **kw)  # type: ignore[arg-type]
            out[rank, worker] = reader_ids(ds, rank, worker, workers)
    return out


@pytest.mark.parametrize("shuffle", [False, True])
def test_three_replicas_two_workers_seven_uneven_files_exactly_once(
    storage_root: str, id_files: Callable[..., list[str]], shuffle: bool
) -> None:
    id_files(storage_root)
    for epoch in range(2):
        seen: Counter[int] = Counter()
        for rank in range(3):
            for worker in range(2):
                ds = open_dataset(
                    f"{storage_root}/part-*.jsonl",
                    rank=rank,
                    world_size=3,
                    shuffle=shuffle,
                    seed=11,
                    shuffle_buffer=8,
                    equalize=None,  # every record exactly once, shares unequal
                )
                ds.set_epoch(epoch)
                seen.update(reader_ids(ds, rank, worker, 2))
        assert sorted(seen) == list(range(TOTAL))
        assert set(seen.values()) == {1}


def test_fewer_files_than_readers_strides_records(tmp_path, id_files: Callable[..., list[str]]) -> None:
    root = str(tmp_path)
    id_files(root, [10, 3])  # 2 files, 6 readers
    shares = all_readers(root, 3, 2, shuffle=True, seed=1, shuffle_buffer=4, equalize=None)
    merged = [i for ids in shares.values() for i in ids]
    assert sorted(merged) == list(range(13))
    assert {len(ids) for ids in shares.values()} <= {2, 3}  # balanced to within one record


def test_shuffle_changes_with_epoch_and_seed_and_is_deterministic(tmp_path, id_files) -> None:
    id_files(str(tmp_path))
    pattern = f"{tmp_path}/part-*.jsonl"

    def order(seed: int, epoch: int) -> list[int]:
        ds = open_dataset(pattern, seed=seed, shuffle_buffer=50, rank=0, world_size=1)
        ds.set_epoch(epoch)
        return [r["id"] for r in ds]

    assert order(1, 0) == order(1, 0)
    assert order(1, 0) != order(1, 1)
    assert order(1, 0) != order(2, 0)
    assert sorted(order(1, 1)) == list(range(TOTAL))
    plain = [r["id"] for r in open_dataset(pattern, shuffle=False, rank=0, world_size=1)]
    assert plain == list(range(TOTAL))


def test_iterating_again_moves_to_the_next_epoch(tmp_path, id_files) -> None:
    id_files(str(tmp_path))
    ds = open_dataset(f"{tmp_path}/part-*.jsonl", seed=3, rank=0, world_size=1)
    assert ds.count() == TOTAL and len(ds.files) == 7
    first = [r["id"] for r in ds]
    assert ds.epoch == 1
    second = [r["id"] for r in ds]
    assert sorted(first) == sorted(second) and first != second
    ds.set_epoch(0)
    assert [r["id"] for r in ds] == first


@pytest.mark.parametrize("how", ["drop_remainder", "pad"])
def test_equalize_gives_every_reader_the_same_count(storage_root: str, id_files, how: str) -> None:
    id_files(storage_root)  # 216 records over 6 readers: 36 each; batch 5 -> 35 (drop) or 40 (pad)
    shares = all_readers(storage_root, 3, 2, shuffle=True, seed=5, equalize=how, batch_size=5)
    assert {len(ids) for ids in shares.values()} == {35 if how == "drop_remainder" else 40}
    merged = Counter(i for ids in shares.values() for i in ids)
    if how == "drop_remainder":
        assert set(merged.values()) == {1} and len(merged) == 210  # no duplicates, 6 dropped
    else:
        assert set(merged) == set(range(TOTAL))  # nothing lost; padding repeats 24 records
        assert sum(merged.values()) == 240


def test_rank_and_world_size_validation(tmp_path, id_files) -> None:
    id_files(str(tmp_path), [3])
    with pytest.raises(ConfigError, match="both rank and world_size"):
        open_dataset(f"{tmp_path}/part-*.jsonl", rank=1)
    with pytest.raises(ConfigError, match=r"rank=3 is not in \[0, world_size=2\)"):
        open_dataset(f"{tmp_path}/part-*.jsonl", rank=3, world_size=2)


def test_default_topology_without_distributed_is_single_replica(tmp_path, id_files, monkeypatch) -> None:
    for name in ("RANK", "WORLD_SIZE", "CLUSTER_SPEC", "TF_CONFIG"):
        monkeypatch.delenv(name, raising=False)
    id_files(str(tmp_path), [3])
    assert open_dataset(f"{tmp_path}/part-*.jsonl").topology() == Topology(0, 1, 0, 1)


def test_topology_follows_the_cluster_and_evaluators_read_everything(tmp_path, id_files, vertex_env) -> None:
    id_files(str(tmp_path), [3])
    vertex_env(workers=2, task=("workerpool1", 1))
    assert open_dataset(f"{tmp_path}/part-*.jsonl").topology() == Topology(2, 3, 0, 1)
    vertex_env(workers=2, evaluators=1, task=("workerpool3", 0))
    assert open_dataset(f"{tmp_path}/part-*.jsonl").topology() == Topology(0, 1, 0, 1)


def test_plan_helpers() -> None:
    units = [Unit(i) for i in range(7)]
    order = epoch_order(units, seed=0, epoch=0, shuffle=True)
    assert sorted(u.source for u in order) == list(range(7)) and order == epoch_order(units, 0, 0, True)
    assert assign(order, 1, 6) == ([order[1]], 1, 0)
    assert assign(order[:2], 4, 6) == (order[:2], 6, 4)
    assert reader_counts(units[:2], [10, 3], 6) == [3, 2, 2, 2, 2, 2]


def test_default_gives_every_rank_the_same_number_of_batches(tmp_path, id_files) -> None:
    id_files(str(tmp_path), [10, 10, 5])  # without equalizing: 4 batches of 4 on one rank, 3 on the other
    pattern = f"{tmp_path}/part-*.jsonl"
    for shuffle in (False, True):
        shares = [
            [r["id"] for r in open_dataset(pattern, rank=rank, world_size=2, batch_size=4, shuffle=shuffle)]
            for rank in range(2)
        ]
        assert len(shares[0]) == len(shares[1]) == 12  # 3 whole batches each, no record twice
        assert len(set(shares[0]) | set(shares[1])) == 24
    assert open_dataset(pattern, rank=0, world_size=2).equalized
    unequal = [open_dataset(pattern, rank=r, world_size=2, equalize=None, shuffle=False) for r in range(2)]
    assert not unequal[0].equalized
    assert sorted(len(list(ds)) for ds in unequal) == [10, 15]  # the explicit opt-out reads everything
    single = open_dataset(pattern, rank=0, world_size=1, batch_size=4)
    assert single.equalized and len(list(single)) == 25  # one replica: nothing dropped


def test_default_equalizes_for_the_cluster_world(tmp_path, id_files, vertex_env) -> None:
    id_files(str(tmp_path), [10, 10, 5])
    vertex_env(workers=1, task=("workerpool1", 0))
    ds = open_dataset(f"{tmp_path}/part-*.jsonl", batch_size=4)
    assert ds.equalized and ds.topology().world_size == 2 and len(list(ds)) == 12

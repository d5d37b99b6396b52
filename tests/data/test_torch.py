"""The torch adapter in a real DataLoader with worker processes."""

from __future__ import annotations

import os
from collections import Counter
from typing import Any

import pytest

from vertexrt.data import open_dataset
from vertexrt.data.formats.jsonl import JSONL

torch = pytest.importorskip("torch")
from torch.utils.data import DataLoader  # noqa: E402

from .conftest import SIZES_7  # noqa: E402

TOTAL = sum(SIZES_7)


class CountingJSONL(JSONL):
    """JSONL that appends ``<pid> <what>`` to a log file each time it counts records (any process)."""

    def __init__(self, log: str):
        super().__init__()
        self.log = log

    def count(self, source, errors) -> int:  # type: ignore[no-untyped-def]
        self._note(f"{source.uri}")
        return super().count(source, errors)

    def count_piece(self, source, start: int, end: int, errors) -> int:  # type: ignore[no-untyped-def]
        self._note(f"{source.uri}[{start}:{end}]")
        return super().count_piece(source, start, end, errors)

    def _note(self, what: str) -> None:
        with open(self.log, "a") as f:
            f.write(f"{os.getpid()} {what}\n")


def ids_of(batches: list[dict[str, object]]) -> list[int]:
    return [int(i) for batch in batches for i in batch["id"]]  # type: ignore[attr-defined]


@pytest.mark.slow
def test_dataloader_two_workers_exactly_once_and_set_epoch_reaches_persistent_workers(
    tmp_path, id_files
) -> None:
    id_files(str(tmp_path))
    ds = open_dataset(f"{tmp_path}/part-*.jsonl", seed=3, shuffle_buffer=8, rank=0, world_size=1).as_torch()
    loader = DataLoader(
        ds, batch_size=4, num_workers=2, persistent_workers=True, multiprocessing_context="fork"
    )
    epochs = []
    for epoch in range(3):
        ds.set_epoch(epoch)
        epochs.append(ids_of(list(loader)))
    for ids in epochs:
        assert Counter(ids) == Counter(range(TOTAL))  # each record once per epoch across both workers
    assert epochs[0] != epochs[1] != epochs[2]
    ds.set_epoch(1)
    assert ids_of(list(loader)) == epochs[1]  # the epoch, not a worker-local counter, picks the order
    del loader


@pytest.mark.slow
def test_two_replicas_times_two_workers_with_equal_batch_counts(tmp_path, id_files) -> None:
    id_files(str(tmp_path))
    seen: Counter[int] = Counter()
    batches = []
    for rank in range(2):
        ds = open_dataset(
            f"{tmp_path}/part-*.jsonl", rank=rank, world_size=2, equalize="drop_remainder", batch_size=4
        ).as_torch()
        got = list(DataLoader(ds, batch_size=4, num_workers=2))
        batches.append(len(got))
        seen.update(ids_of(got))
    assert batches == [26, 26]  # 4 readers x 54 records -> 52 each (multiple of 4) -> 13 batches per worker
    assert set(seen.values()) == {1} and len(seen) == 208  # no record twice across replicas and workers


def test_in_process_loader_state_dict_resumes(tmp_path, id_files) -> None:
    id_files(str(tmp_path))
    ds = open_dataset(f"{tmp_path}/part-*.jsonl", seed=1, shuffle_buffer=10, rank=0, world_size=1).as_torch()
    full = ids_of(list(DataLoader(ds, batch_size=5)))
    ds.set_epoch(0)
    it = iter(DataLoader(ds, batch_size=5))
    head = ids_of([next(it) for _ in range(7)])
    state = ds.state_dict()
    del it
    again = open_dataset(
        f"{tmp_path}/part-*.jsonl", seed=1, shuffle_buffer=10, rank=0, world_size=1
    ).as_torch()
    again.load_state_dict(state)
    assert head + ids_of(list(DataLoader(again, batch_size=5))) == full


@pytest.mark.slow
def test_dataloader_workers_read_gcs_after_the_parent_used_gcsfs(gcs_server, id_files) -> None:
    root = f"gs://{gcs_server.bucket}/torch-fork"
    id_files(root)  # the parent lists and writes through gcsfs before the workers fork
    ds = open_dataset(f"{root}/part-*.jsonl", seed=2, rank=0, world_size=1).as_torch()
    loader = DataLoader(ds, batch_size=8, num_workers=2, multiprocessing_context="fork", timeout=120)
    assert Counter(ids_of(list(loader))) == Counter(range(TOTAL))


@pytest.mark.slow
@pytest.mark.parametrize("workers", [0, 2])
def test_vertexrt_dataloader_state_dict_is_exact_with_workers(tmp_path, id_files, workers: int) -> None:
    import json

    from vertexrt.data.torch import DataLoader as ResumableLoader

    id_files(str(tmp_path))
    pattern = f"{tmp_path}/part-*.jsonl"

    def loader() -> ResumableLoader:
        ds = open_dataset(pattern, seed=5, shuffle_buffer=16, rank=0, world_size=1)
        return ResumableLoader(ds, batch_size=4, num_workers=workers, persistent_workers=workers > 0)

    first = loader()
    first.set_epoch(1)
    full = ids_of(list(first))
    assert sorted(full) == list(range(TOTAL)) and first.data.epoch == 2
    for stop in (0, 1, 7, 30, 53, 54):  # 54 batches in the epoch (some workers finish earlier)
        run = loader()
        run.set_epoch(1)
        it = iter(run)
        head = ids_of([next(it) for _ in range(stop)])
        state = json.loads(json.dumps(run.state_dict()))
        del it, run
        again = loader()
        again.load_state_dict(state)
        again.set_epoch(1)
        rest = ids_of(list(again))
        assert Counter(head + rest) == Counter(full), f"stop={stop} state={state}"
        if workers == 0:
            assert head + rest == full


@pytest.mark.parametrize("how", ["workers", "persistent", "torch-loader"])
def test_equalize_counts_once_per_rank_before_the_workers_fork(
    tmp_path, id_files, monkeypatch, how: str
) -> None:
    from vertexrt.data.torch import DataLoader as ResumableLoader

    monkeypatch.setattr("vertexrt.data.formats.base.MIN_PIECE_BYTES", 64)  # cut small files (forked too)
    id_files(str(tmp_path), [40, 40, 40])  # 3 files < 2 ranks x 2 workers: the workers read file pieces
    log = str(tmp_path / "counts.log")
    ds = open_dataset(
        f"{tmp_path}/part-*.jsonl", format=CountingJSONL(log), rank=0, world_size=2, equalize="drop_remainder"
    )
    options = {"batch_size": 4, "num_workers": 2, "multiprocessing_context": "fork"}
    if how == "torch-loader":  # a plain torch DataLoader: the iterable is prepared for its workers
        loader: Any = DataLoader(ds.as_torch(num_workers=2), **options)
    else:
        loader = ResumableLoader(ds, persistent_workers=how == "persistent", **options)
    for epoch in range(2):
        loader.dataset.set_epoch(epoch)
        ids = ids_of(list(loader))
        assert len(ids) == len(set(ids)) == 60  # rank 0's equal half (2 x 30), in whole batches
    with open(log) as f:
        calls = [line.split(" ", 1) for line in f.read().splitlines()]
    assert {pid for pid, _ in calls} == {str(os.getpid())}  # counted here, not in a worker
    assert len(calls) == len({what for _, what in calls})  # each file or piece counted once

"""Healthy slow phases under @vertexrt.main with VERTEXRT_HANG_TIMEOUT=1: none may be ended as a hang.

Usage: python slow_phases.py MODE DIR. Each slow phase takes SLOW seconds (2.5 limits) without a step; the
process prints FINISHED and exits 0 unless the watchdog ends it.

first_step: a Trainer whose first step is slow (as when it compiles).
evaluate: a Trainer whose evaluate() is slow.
snapshot: a Trainer whose checkpoint snapshot (a tracked object's state_dict()) is slow, saved every step.
loader_startup: a plain loop over vertexrt's DataLoader for two epochs; its worker starts slowly each epoch.
counting: a plain loop that, after two steps, reads a dataset with ``equalize`` whose records count slowly.
orphan: a step stuck waiting for a DataLoader worker that is itself stuck (the watchdog must fire, and must
    not leave the worker behind); the worker writes its pid to DIR/worker.pid.
"""

import json
import os
import sys
import threading
import time
from typing import Any

import torch

import vertexrt
from vertexrt.checkpoint import CheckpointManager, EveryNSteps
from vertexrt.data import open_dataset
from vertexrt.data.formats.jsonl import JSONL

SLOW = 2.5


class Slow:
    """A tracked object whose snapshot takes SLOW seconds."""

    def state_dict(self) -> dict[str, int]:
        time.sleep(SLOW)
        return {"n": 1}

    def load_state_dict(self, state: dict[str, int]) -> None:
        pass


class Phases(vertexrt.Trainer):
    def __init__(self, ctx: vertexrt.Context, mode: str, directory: str) -> None:
        manager = CheckpointManager(os.path.join(directory, "ckpt"), save_policy=EveryNSteps(1))
        super().__init__(ctx, max_steps=3, eval_every=1 if mode == "evaluate" else None, checkpoints=manager)
        self.mode = mode

    def setup(self) -> None:
        self.train_data = list(range(3))
        if self.mode == "snapshot":
            self.slow = Slow()

    def train_step(self, batch: int) -> dict[str, float]:
        if self.mode == "first_step" and self.step == 0:
            time.sleep(SLOW)
        return {"loss": 0.0}

    def evaluate(self) -> dict[str, float]:
        if self.mode == "evaluate":
            time.sleep(SLOW)
        return {"accuracy": 1.0}


class StuckAfterOne(torch.utils.data.IterableDataset):  # type: ignore[type-arg]
    def __init__(self, directory: str) -> None:
        self.directory = directory

    def __iter__(self):  # type: ignore[no-untyped-def]
        with open(os.path.join(self.directory, "worker.pid"), "w") as f:  # before step 1 can complete
            f.write(str(os.getpid()))
        yield 1
        threading.Event().wait()  # stuck reading the next record


class SlowCountJSONL(JSONL):
    """JSON Lines whose record count (for ``equalize``) takes SLOW seconds, as for many large files."""

    def count(self, source: Any, errors: Any) -> int:
        time.sleep(SLOW)
        return int(super().count(source, errors))


def counting(ctx: vertexrt.Context, directory: str) -> None:
    path = os.path.join(directory, "records.jsonl")
    with open(path, "w") as f:
        f.writelines(json.dumps({"x": i}) + "\n" for i in range(8))
    # Opened before the countdown is armed: listing the files (and the first use of fsspec) is not a
    # phase, and on a CPU-starved machine it alone took longer than the 1 s limit after step 2.
    data = open_dataset(path, format=SlowCountJSONL(), shuffle=False, equalize="drop_remainder")
    for step in (1, 2):
        ctx.step(step)
    for step, _record in enumerate(data, start=3):
        ctx.step(step)


def slow_worker_start(worker_id: int) -> None:
    time.sleep(SLOW)


def loader_startup(ctx: vertexrt.Context, directory: str) -> None:
    from vertexrt.data.torch import DataLoader

    path = os.path.join(directory, "records.jsonl")
    with open(path, "w") as f:
        f.writelines(json.dumps({"x": i}) + "\n" for i in range(8))
    loader = DataLoader(
        open_dataset(path, shuffle=False), batch_size=4, num_workers=1, worker_init_fn=slow_worker_start
    )
    step = 0
    for _ in range(2):
        for _batch in loader:
            step += 1
            ctx.step(step)


@vertexrt.main(preflight=False)
def main(ctx: vertexrt.Context) -> None:
    mode, directory = sys.argv[1], sys.argv[2]
    if mode == "loader_startup":
        loader_startup(ctx, directory)
    elif mode == "counting":
        counting(ctx, directory)
    elif mode == "orphan":
        loader = torch.utils.data.DataLoader(StuckAfterOne(directory), batch_size=None, num_workers=1)
        for step, _batch in enumerate(loader, start=1):
            ctx.step(step)
    else:
        Phases(ctx, mode, directory).fit()
    print("FINISHED", flush=True)


if __name__ == "__main__":
    main()

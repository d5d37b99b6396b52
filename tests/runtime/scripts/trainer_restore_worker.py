"""One rank of a multi-replica Trainer that trains, checkpointing to Cloud Storage, then restores in a fresh
fit(); each phase's storage requests go through a counting proxy of its own.

Usage: python trainer_restore_worker.py RANK WORLD PORT ROOT LOCAL_DIR TRAIN_ENDPOINT RESTORE_ENDPOINT.
Prints one JSON line last: the step the second fit() restored and its weights.
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist

import vertexrt
from vertexrt.checkpoint import CheckpointManager, EveryNSteps


class Tiny(vertexrt.Trainer):
    def setup(self) -> None:
        torch.manual_seed(0)
        self.model = torch.nn.Linear(2, 1)
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.1)
        self.train_data = [torch.ones(1, 2)] * 4

    def train_step(self, batch: torch.Tensor) -> dict[str, float]:
        self.optimizer.zero_grad()
        self.model(batch).sum().backward()
        self.optimizer.step()
        return {}


def fit(root: str, endpoint: str, max_steps: int) -> Tiny:
    os.environ["STORAGE_EMULATOR_HOST"] = endpoint  # this phase's requests: its own counting proxy
    ctx = vertexrt.Context.create()
    ctx.checkpoints = CheckpointManager(root, save_policy=EveryNSteps(2), async_save=False)
    trainer = Tiny(
        ctx, max_steps=max_steps, preflight=False, ddp=False, progress_bar=False, tensorboard=False
    )
    trainer.fit()
    ctx.checkpoints.close()
    dist.barrier()
    return trainer


def main(rank: int, world: int, port: int, root: str, local: str, train: str, restore: str) -> None:
    os.environ.update(VERTEXRT_LOCAL_DIR=local, RANK=str(rank), WORLD_SIZE=str(world))
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    trained = fit(root, train, 4)
    again = fit(root, restore, 4)  # restores step 4: nothing left to train
    weights = again.model.weight.tolist()
    assert weights == trained.model.weight.tolist()
    dist.destroy_process_group()
    print(json.dumps({"step": again.step, "weights": weights}), flush=True)


if __name__ == "__main__":
    from rank_exit import exit_after

    a = sys.argv
    exit_after(lambda: main(int(a[1]), int(a[2]), int(a[3]), a[4], a[5], a[6], a[7]))

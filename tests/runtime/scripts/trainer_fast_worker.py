"""One rank of a 2-replica Trainer with a fast tier every 2 steps (VERTEXRT_FAST_CHECKPOINT_EVERY) and
durable saves every 5, each rank with its own local directory.

Usage: python trainer_fast_worker.py RANK WORLD PORT ROOT DIE_AT. With DIE_AT >= 0, every rank SIGKILLs
itself before training step DIE_AT + 1, once the fast steps so far are complete (a whole-job restart).
Prints one JSON line: the step its fit() started from and the final weights.
"""

from __future__ import annotations

import json
import os
import signal
import sys

import torch
import torch.distributed as dist

import vertexrt
from vertexrt.checkpoint import CheckpointManager, EveryNSteps

TOTAL = 12


class Replica(vertexrt.Trainer):
    def __init__(self, *args: object, die_at: int, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.die_at, self.started_at = die_at, -1

    def setup(self) -> None:
        torch.manual_seed(0)
        self.model = torch.nn.Linear(2, 1)
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=0.05)
        self.train_data = [torch.full((4, 2), float(self.ctx.rank + i)) for i in range(TOTAL)]

    def train_step(self, x: torch.Tensor) -> dict[str, float]:
        if self.started_at < 0:
            self.started_at = self.step
        if self.step == self.die_at:
            self.checkpoints.wait()  # this rank's fast steps and its peer's copies are complete
            dist.barrier()
            os.kill(os.getpid(), signal.SIGKILL)
        loss = (self.model(x) - 1.0).pow(2).mean()
        self.optimizer.zero_grad()
        loss.backward()
        self.optimizer.step()
        return {}


def main(rank: int, world: int, port: int, root: str, die_at: int) -> None:
    os.environ.update(VERTEXRT_LOCAL_DIR=root, RANK=str(rank), WORLD_SIZE=str(world))
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), VERTEXRT_FAST_CHECKPOINT_EVERY="2")
    os.environ["VERTEXRT_LOCAL_CHECKPOINT_DIR"] = os.path.join(root, f"vm{rank}")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    ctx = vertexrt.Context.create()
    ctx.checkpoints = CheckpointManager(os.path.join(root, "ckpt"), save_policy=EveryNSteps(5))
    trainer = Replica(
        ctx, die_at=die_at, max_steps=TOTAL, preflight=False, progress_bar=False, tensorboard=False
    )
    trainer.fit()
    ctx.checkpoints.close()
    weights = [*trainer.model.weight.flatten().tolist(), *trainer.model.bias.tolist()]
    print(json.dumps({"started_at": trainer.started_at, "weights": weights}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    from rank_exit import exit_after

    a = sys.argv
    exit_after(lambda: main(int(a[1]), int(a[2]), int(a[3]), a[4], int(a[5])))

"""One rank of a 2-replica Trainer whose restore hits a plain I/O error on rank 1 (a FUSE EIO).

Usage: python restore_error_worker.py RANK WORLD PORT ROOT. The first run trains and checkpoints; the second
restores with rank 1's reads failing. Prints one JSON line: the error this rank's fit() raised.
"""

from __future__ import annotations

import errno
import json
import os
import sys

import torch
import torch.distributed as dist

import vertexrt
from vertexrt.checkpoint import CheckpointManager, EveryNSteps


class Tiny(vertexrt.Trainer):
    def setup(self) -> None:
        self.model = torch.nn.Linear(2, 1)
        self.train_data = [torch.ones(1, 2)] * 4

    def train_step(self, batch: torch.Tensor) -> dict[str, float]:
        return {}


def main(rank: int, world: int, port: int, root: str) -> None:
    os.environ.update(
        VERTEXRT_LOCAL_DIR=root,
        RANK=str(rank),
        WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    # gloo's own collective timeout (default 30 min) is left alone: a fixed one is a ceiling on how far one
    # healthy rank may lag the other (20 s was exceeded on a CPU-starved machine: the chief's restore
    # collective timed out while rank 1 was still getting there). A hang still fails the test, at the
    # runner's timeout, and a correct library needs no timeout to stop both ranks on rank 1's read error.
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    ctx = vertexrt.Context.create()
    ctx.checkpoints = CheckpointManager(os.path.join(root, "ckpt"), save_policy=EveryNSteps(2))
    Tiny(ctx, max_epochs=1, preflight=False, ddp=False).fit()
    ctx.checkpoints.close()
    dist.barrier()
    if rank == 1:
        from vertexrt.checkpoint import restoring

        def unreadable(strategy: object, *args: object, **kwargs: object) -> None:
            raise OSError(errno.EIO, "Input/output error", os.path.join(root, "ckpt"))

        restoring.verify = unreadable  # type: ignore[assignment]  # this rank's reads of the data files
    again = vertexrt.Context.create()
    again.checkpoints = CheckpointManager(os.path.join(root, "ckpt"), save_policy=EveryNSteps(2))
    try:
        Tiny(again, max_epochs=2, preflight=False, ddp=False).fit()
        report = {"type": None, "message": ""}
    except Exception as exc:
        report = {"type": type(exc).__name__, "message": str(exc)}
    print(json.dumps(report), flush=True)
    os._exit(0)  # the process group may be broken: do not wait for a clean teardown


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])

"""One rank of the test where reading a step fails on one rank with a plain OSError (a FUSE EIO).

Usage: python agree_oserror_worker.py RANK WORLD PORT ROOT. Prints one JSON line: the error this rank got.
"""

from __future__ import annotations

import datetime
import errno
import json
import os
import sys

import torch.distributed as dist
from rank_exit import exit_after

from vertexrt.checkpoint import CheckpointManager, restoring


def main(rank: int, world: int, port: int, root: str) -> None:
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=20),  # a rank left waiting fails in 20 s instead of 30 min
    )
    mgr = CheckpointManager(os.path.join(root, "ckpt"), async_save=False)
    mgr.save(1, {"step": 1})
    dist.barrier()
    if rank == 1:

        def unreadable(strategy, step, *args, **kwargs):
            raise OSError(errno.EIO, "Input/output error", f"{strategy.root}/step_{step}/manifest.json")

        restoring.verify = unreadable  # type: ignore[assignment]
    try:
        mgr.restore()
        report = {"type": None, "message": ""}
    except Exception as exc:
        report = {"type": type(exc).__name__, "message": str(exc)}
    print(json.dumps(report), flush=True)
    os._exit(0)  # the process group may be broken: do not wait for a clean teardown


if __name__ == "__main__":
    exit_after(lambda: main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]))

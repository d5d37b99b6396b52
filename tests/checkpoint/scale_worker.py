"""One rank of the checkpoint scale tests: its storage requests go through its own counting proxy.

Usage: python scale_worker.py RANK WORLD PORT ROOT ENDPOINT PHASE, PHASE one of ``save`` (a sharded step 1),
``restore`` (the newest step), ``exists`` (saving step 1 again) and ``fallback`` (steps 1 and 2; rank 1's
data of step 2 damaged; every rank restores step 1). Prints a JSON report last.
"""

from __future__ import annotations

import json
import os
import sys


def state(rank: int) -> dict:
    import numpy as np

    return {
        "rank": rank,
        "w": np.arange(64, dtype=np.int64) * (rank + 1),
        "names": [f"leaf{i}" for i in range(8)],
    }


def main(rank: int, world: int, port: int, root: str, endpoint: str, phase: str) -> None:
    os.environ["STORAGE_EMULATOR_HOST"] = endpoint  # before anything makes a Cloud Storage client
    import torch.distributed as dist

    from vertexrt.checkpoint import CheckpointManager
    from vertexrt.errors import StepExistsError

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    report: dict = {}
    mgr = CheckpointManager(root)
    if phase == "save":
        assert mgr.save(1, state(rank), shard=rank)
        mgr.wait()
    elif phase == "restore":
        report["restored"] = int(mgr.restore()["rank"])
    elif phase == "exists":
        try:
            mgr.save(1, state(rank), shard=rank)
            mgr.wait()
        except StepExistsError as exc:
            report["error"] = type(exc).__name__
    elif phase == "fallback":
        for step in (1, 2):
            mgr.save(step, {**state(rank), "step": step}, shard=rank)
            mgr.wait()
        dist.barrier()
        if rank == 1:
            from vertexrt import paths

            fs, path = paths.filesystem(f"{root}/step_{2:010d}")
            mine = [f for f in fs.ls(path, refresh=True) if ".s1." in f.rsplit("/", 1)[-1]]
            data = bytearray(fs.cat_file(mine[0]))
            data[-1] ^= 0xFF
            fs.pipe_file(mine[0], bytes(data))
        dist.barrier()
        got = mgr.restore()
        report["restored"] = [int(got["step"]), int(got["rank"])]
    mgr.close()
    dist.destroy_process_group()
    print(json.dumps(report), flush=True)


if __name__ == "__main__":
    from rank_exit import exit_after

    exit_after(lambda: main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), *sys.argv[4:7]))

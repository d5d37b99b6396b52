"""One rank of the checkpoint scale tests: each phase's storage requests go through a counting proxy of its
own (one gcsfs client per endpoint).

Usage: python scale_worker.py RANK WORLD PORT ROOT PHASE=ENDPOINT..., phases run in order: ``save`` (a
sharded step 1), ``restore`` (the newest step), ``exists`` (saving step 1 again) and ``fallback`` (steps 1
and 2; rank 1's data of step 2 damaged; every rank restores step 1). Prints a JSON report per phase last.
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


def main(rank: int, world: int, port: int, root: str, phases: list[str]) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    report: dict = {}
    for phase, _, endpoint in (p.partition("=") for p in phases):
        os.environ["STORAGE_EMULATOR_HOST"] = endpoint  # this phase's requests: its own counting proxy
        report[phase] = run_phase(phase, rank, root, dist)
        dist.barrier()
    dist.destroy_process_group()
    print(json.dumps(report), flush=True)


def run_phase(phase: str, rank: int, root: str, dist) -> object:
    from vertexrt.checkpoint import CheckpointManager
    from vertexrt.errors import StepExistsError

    outcome: object = None
    with CheckpointManager(root) as mgr:
        if phase == "save":
            assert mgr.save(1, state(rank), shard=rank)
        elif phase == "restore":
            outcome = int(mgr.restore()["rank"])
        elif phase == "exists":
            try:
                mgr.save(1, state(rank), shard=rank)
                mgr.wait()
            except StepExistsError as exc:
                outcome = type(exc).__name__
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
            outcome = [int(got["step"]), int(got["rank"])]
    return outcome


if __name__ == "__main__":
    from rank_exit import exit_after

    exit_after(lambda: main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5:]))

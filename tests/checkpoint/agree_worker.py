"""One rank of the agreement tests. Usage: python agree_worker.py RANK WORLD PORT ROOT

Prints one JSON line: what this rank saw (the parent compares the ranks).
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist
from rank_exit import exit_after

from vertexrt.checkpoint import CheckpointManager, EveryNSeconds, LastSave
from vertexrt.errors import CheckpointError


class ChiefClock:
    """Like a clock on rank 0 only: due from step 3 on, and again from step 57 on (rank 1: always due)."""

    def should_save(self, step: int, last: LastSave) -> bool:
        return (step >= 3 and last.step is None) or (step >= 57 and last.step is not None and last.step < 57)


def main(rank: int, world: int, port: int, root: str) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    report: dict[str, object] = {}
    counts = {"broadcast_object_list": 0, "broadcast": 0, "all_reduce": 0}
    for name in counts:
        real = getattr(dist, name)

        def counted(*args, _real=real, _name=name, **kwargs):
            counts[_name] += 1
            return _real(*args, **kwargs)

        setattr(dist, name, counted)

    # 1. A clock-based policy: 200 save() calls, no pickled broadcast, the same saves on every rank.
    policy = ChiefClock() if rank == 0 else EveryNSeconds(1e-9)
    with CheckpointManager(os.path.join(root, "timed"), save_policy=policy, async_save=False) as timed:
        saved = [step for step in range(200) if timed.save(step, {"step": step})]
    report["saved"] = saved
    report["collectives"] = dict(counts)

    # 2. Sharded steps 1 and 2; rank 1's shard of step 2 is damaged: every rank restores step 1.
    sharded = os.path.join(root, "sharded")
    mgr = CheckpointManager(sharded, async_save=False)
    for step in (1, 2):
        mgr.save(step, {"w": torch.full((50_000,), float(step * 10 + rank)), "step": step}, shard=rank)
    dist.barrier()
    if rank == 1:
        names = os.listdir(os.path.join(sharded, "step_0000000002"))
        name = next(n for n in names if ".s1." in n and n.endswith(".bin"))  # a data file, not the body
        path = os.path.join(sharded, "step_0000000002", name)
        with open(path, "r+b") as f:
            f.seek(1000)
            byte = f.read(1)[0]
            f.seek(1000)
            f.write(bytes([byte ^ 0xFF]))
    dist.barrier()
    got = mgr.restore()
    report["restored"] = [mgr.restored_step, float(got["w"][0])]
    mgr.close()

    # 3. A sharded step written by another world size: the same clear error on every rank, no hang.
    dist.barrier()
    if rank == 0:
        manifest_path = os.path.join(sharded, "step_0000000001", "manifest.json")
        with open(manifest_path) as f:
            manifest = json.load(f)
        manifest["world_size"] = 1
        manifest["shards"] = manifest["shards"][:1]
        with open(manifest_path, "w") as f:
            f.write(json.dumps(manifest))
        os.remove(os.path.join(sharded, "step_0000000002", "manifest.json"))
    dist.barrier()
    try:
        CheckpointManager(sharded).restore()
        report["world_error"] = None
    except CheckpointError as exc:
        report["world_error"] = str(exc)
    dist.barrier()
    dist.destroy_process_group()
    print(json.dumps(report), flush=True)


if __name__ == "__main__":
    exit_after(lambda: main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]))

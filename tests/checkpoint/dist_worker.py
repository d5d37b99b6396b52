"""One rank of the gloo checkpoint test. Usage: python dist_worker.py RANK WORLD PORT ROOT"""

from __future__ import annotations

import os
import signal
import sys
import time

import torch
import torch.distributed as dist
from rank_exit import exit_after

from vertexrt.checkpoint import CheckpointManager, EveryNSeconds


def main(rank: int, world: int, port: int, root: str) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    chief_pid = [os.getpid()]
    dist.broadcast_object_list(chief_pid, src=0)
    mgr = CheckpointManager(root)
    assert (mgr.rank, mgr.world_size) == (rank, world)

    # Replicated state: only the chief writes; every rank restores it.
    assert mgr.save(1, {"w": torch.full((1000,), 7.0), "step": 1})
    mgr.wait()
    dist.barrier()
    got = mgr.restore()
    assert got["step"] == 1 and torch.equal(got["w"], torch.full((1000,), 7.0))
    assert mgr.metadata(1)["world_size"] == world and not mgr.metadata(1)["sharded"]
    manifest = mgr._manifest(1)
    assert f"-{chief_pid[0]}-" in manifest["shards"][0]["prefix"], "a non-chief rank wrote replicated state"

    # Per-rank shards: every rank writes its own; one commit after all are written.
    assert mgr.save(2, {"w": torch.full((500,), float(rank)), "rank": rank}, shard=rank)
    mgr.wait()
    dist.barrier()
    mine = mgr.restore(step=2)
    assert mine["rank"] == rank and torch.equal(mine["w"], torch.full((500,), float(rank)))
    other = mgr.restore(step=2, shard=(rank + 1) % world)
    assert other["rank"] == (rank + 1) % world
    assert mgr._manifest(2)["sharded"] and len(mgr._manifest(2)["shards"]) == world
    dist.barrier()

    # A clock-based save decision is rank 0's, on every rank (no rank waits at a barrier alone).
    policy = EveryNSeconds(3600) if rank == 0 else EveryNSeconds(1e-9)
    timed = CheckpointManager(root, save_policy=policy)
    time.sleep(0.01)
    assert timed.save(3, {"x": 1}) is False
    timed.close()

    # Preemption: a SIGTERM on rank 1 only is seen by every rank.
    mgr.save_on_preemption()
    dist.barrier()
    if rank == world - 1:
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.05)
    answers = [mgr.preemption_requested() for _ in range(3)]  # agreed one check after the notice
    assert answers[-1] is True and answers == sorted(answers), answers
    assert mgr.save(4, {"final": rank}, force=True)  # synchronous after a preemption notice
    assert mgr._pending is None
    dist.barrier()
    assert mgr.latest_step() == 4
    mgr.close()
    dist.destroy_process_group()
    print("OK", flush=True)


if __name__ == "__main__":
    exit_after(lambda: main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]))

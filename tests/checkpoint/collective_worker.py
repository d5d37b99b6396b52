"""One rank of the collective-group test. Usage: python collective_worker.py RANK WORLD PORT ROOT

The default process group stands in for a GPU job's NCCL group: a registered backend that is not gloo and
refuses every collective. The checkpoint manager's collectives must all run on the gloo side group
(``collectives.cpu_group``); one that reaches the default group fails this rank.
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
from rank_exit import exit_after

from vertexrt.checkpoint import CheckpointManager
from vertexrt.distributed import collectives


class DefaultGroupOnly(dist.ProcessGroup):
    """A process group whose collectives all fail: what a host-side collective must never touch."""

    def getBackendName(self) -> str:
        return "nccl-stand-in"

    def _refuse(self, *args: object, **kwargs: object) -> None:
        raise RuntimeError("a checkpoint collective ran on the default (GPU) process group")

    broadcast = allreduce = allgather = allgather_into_tensor_coalesced = barrier = gather = _refuse
    reduce = scatter = alltoall_base = reduce_scatter = allgather_coalesced = allreduce_coalesced = _refuse


def main(rank: int, world: int, port: int, root: str) -> None:
    dist.Backend.register_backend(
        "nccl_stand_in", lambda store, r, size, timeout: DefaultGroupOnly(r, size), devices=["cpu"]
    )
    address = f"tcp://127.0.0.1:{port}"
    dist.init_process_group("nccl_stand_in", init_method=address, rank=rank, world_size=world)
    assert dist.get_backend() == "nccl_stand_in"

    assert collectives.broadcast(f"token-{rank}", dist) == "token-0"
    assert collectives.all_max([rank, -rank, 0], dist) == [world - 1, 0, 0]
    assert collectives.all_gather(rank * 10, dist) == [r * 10 for r in range(world)]
    sent = [b"ab", b"", b"cde"] if rank == 0 else None
    assert [bytes(b) for b in collectives.broadcast_bytes(sent, [2, 0, 3], dist)] == [b"ab", b"", b"cde"]
    late = collectives.LateBroadcast()
    late.start([rank + 7], dist)
    assert late.result() == [7]

    side = collectives.cpu_group(dist)
    with CheckpointManager(root) as mgr:  # rank and world from torch.distributed
        assert mgr.save(1, {"w": torch.full((100,), 3.0)}, force=True)
        mgr.wait()
        assert mgr.save(2, {"w": torch.full((50,), float(rank))}, force=True, shard=rank)
        mgr.wait()
        dist.barrier(group=side)  # rank 0 has committed step 2
        got = mgr.restore()  # the ranks agree on the newest step
        assert torch.equal(got["w"], torch.full((50,), float(rank)))
        assert torch.equal(mgr.restore(step=1)["w"], torch.full((100,), 3.0))
    print("OK", flush=True)


if __name__ == "__main__":
    exit_after(lambda: main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]))

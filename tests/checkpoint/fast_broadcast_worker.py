"""One rank of the fast-tier broadcast test. Usage: python fast_broadcast_worker.py RANK WORLD PORT ROOT

1. ``collectives.broadcast_bytes`` with small runs: rank 0's buffers (bytes, bytearray, writable and
   read-only arrays, empty ones) reach every rank bit for bit, in the expected number of tensor broadcasts.
2. ``restore_fast_shards``: rank 1 asks for rank 0's 16 MiB state as well as its own (as the Trainer does);
   the object broadcast and the raw tensor broadcasts are counted while it runs.

Prints one JSON line (the counts), then OK.
"""

from __future__ import annotations

import json
import os
import pickle
import sys
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from ckpt_helpers import assert_same_tree
from rank_exit import exit_after

from vertexrt.checkpoint import CheckpointManager, EveryNSteps, FastTier
from vertexrt.distributed import collectives

BIG = 4 << 20  # float32 elements: 16 MiB


def state_of(rank: int) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(rank)
    return {
        "big": torch.randn(BIG, generator=gen),
        "small": torch.arange(5, dtype=torch.int64) + rank,
        "empty": torch.empty(0),
        "n": rank,
    }


class Counting:
    """Counts what goes through the object broadcast (pickled bytes, on rank 0) and the tensor broadcast."""

    def __init__(self) -> None:
        self.objects: list[int] = []
        self.tensors: list[int] = []
        self.original = (dist.broadcast_object_list, dist.broadcast)

    def __enter__(self) -> Counting:
        broadcast_object_list, broadcast = self.original

        def objects(object_list: list[Any], src: int = 0, group: Any = None, device: Any = None) -> None:
            if dist.get_rank() == src:
                self.objects.append(len(pickle.dumps(object_list[0])))
            broadcast_object_list(object_list, src=src, group=group, device=device)

        def tensors(tensor: torch.Tensor, src: int, group: Any = None, async_op: bool = False) -> Any:
            self.tensors.append(tensor.numel() * tensor.element_size())
            return broadcast(tensor, src=src, group=group, async_op=async_op)

        dist.broadcast_object_list, dist.broadcast = objects, tensors  # type: ignore[assignment]
        return self

    def __exit__(self, *exc: object) -> None:
        dist.broadcast_object_list, dist.broadcast = self.original  # type: ignore[assignment]


def bytes_across_runs(rank: int) -> dict[str, Any]:
    sizes = [0, 10, 999, 1000, 2500, 3, 0]
    want = [bytes((i * 7 + j) % 256 for j in range(size)) for i, size in enumerate(sizes)]
    read_only = np.frombuffer(want[4], dtype=np.uint8)
    assert not read_only.flags.writeable
    given = (
        [
            want[0],
            bytearray(want[1]),
            np.frombuffer(bytearray(want[2]), np.uint8),
            want[3],
            read_only,
            want[5],
            np.empty(0, np.uint8),
        ]
        if rank == 0
        else None
    )
    with Counting() as counted:
        got = collectives.broadcast_bytes(given, sizes, dist, run_bytes=1000)
    assert [bytes(memoryview(g)) for g in got] == want, f"rank {rank}: broadcast_bytes changed the bytes"
    return {"runs": counted.tensors}


def fast_restore(rank: int, root: str) -> dict[str, Any]:
    os.environ["VERTEXRT_LOCAL_CHECKPOINT_DIR"] = os.path.join(root, f"local{rank}")
    durable = os.path.join(root, "durable")
    tier = FastTier(every=EveryNSteps(1), peers=0)
    with CheckpointManager(durable, save_policy=EveryNSteps(1000), fast=tier) as mgr:
        mgr.save(1, state_of(rank))  # a fast step only: the durable tier saves every 1000
    parts = [(None, 0)] if rank == 0 else [(None, 0), (None, None)]
    restart = CheckpointManager(durable, save_policy=EveryNSteps(1000), fast=tier)
    with restart as mgr, Counting() as counted:
        restored = mgr.restore_fast_shards(parts)
    assert restored is not None, f"rank {rank}: no fast step restored"
    values, in_durable = restored
    assert not in_durable and mgr.restored_step == 1
    assert_same_tree(values[0], state_of(0), f"rank {rank}: rank 0's state")
    if rank != 0:
        assert_same_tree(values[1], state_of(rank), f"rank {rank}: its own state")
    return {"objects": counted.objects, "tensors": counted.tensors}


def main(rank: int, world: int, port: int, root: str) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    print(json.dumps({**bytes_across_runs(rank), **fast_restore(rank, root)}), flush=True)
    print("OK", flush=True)


if __name__ == "__main__":
    exit_after(lambda: main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]))

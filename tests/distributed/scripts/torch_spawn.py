"""Each node spawns two processes; every process all_reduces rank + 1 over the whole job."""

import json
import os

import torch

from vertexrt.distributed import cluster, init_torch, spawn


def train(local_rank: int) -> None:
    handle = init_torch(timeout=60)
    value = torch.tensor([float(handle.rank + 1)])
    torch.distributed.all_reduce(value)
    c = cluster()
    record = {
        "rank": handle.rank,
        "world_size": handle.world_size,
        "local_rank": local_rank,
        "sum": value.item(),
        "source": c.source,
        "role": c.role,
        "node_rank": c.node_rank,
    }
    os.write(1, f"RESULT {json.dumps(record)}\n".encode())  # one write: the node's processes share stdout
    handle.shutdown()


if __name__ == "__main__":
    spawn(train, nprocs=2)

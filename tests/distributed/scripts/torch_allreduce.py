"""Each rank contributes rank + 1 to a gloo all_reduce and prints what it saw as one JSON line."""

import json
import os
import sys

import torch

from vertexrt.distributed import cluster, init_torch, world_info

handle = init_torch(timeout=60)
value = torch.tensor([float(handle.rank + 1)])
torch.distributed.all_reduce(value)
c = cluster()
info = world_info()
record = {
    "rank": handle.rank,
    "world_size": handle.world_size,
    "local_rank": handle.local_rank,
    "sum": value.item(),
    "source": c.source,
    "role": c.role,
    "node_rank": c.node_rank,
    "num_nodes": c.num_nodes,
    "is_chief": c.is_chief,
    "world_info": [info.rank, info.world_size, info.source],
    "again": init_torch().rank,  # idempotent
}
os.write(1, f"RESULT {json.dumps(record)}\n".encode())  # one write: a node's processes may share stdout
handle.shutdown()
sys.exit(0)

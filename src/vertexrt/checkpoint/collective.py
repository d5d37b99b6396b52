"""Rank, world size and the few collectives the checkpoint manager needs (torch.distributed when initialised).

torch is never imported here: ``torch.distributed`` counts only if the program already imported torch and
initialised a process group.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

log = logging.getLogger(__name__)


def torch_dist() -> Any | None:
    """``torch.distributed`` when a process group is initialised, else None."""
    torch = sys.modules.get("torch")
    if torch is None:
        return None
    dist = getattr(torch, "distributed", None)
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return None
    return dist


def resolve(rank: int | None, world_size: int | None) -> tuple[int, int]:
    """``(rank, world_size)``: the arguments, else torch.distributed, else ``distributed.cluster()``."""
    if rank is not None and world_size is not None:
        return rank, world_size
    dist = torch_dist()
    if dist is not None:
        return (dist.get_rank() if rank is None else rank), (
            dist.get_world_size() if world_size is None else world_size
        )
    try:
        from vertexrt.distributed import cluster

        info = cluster()
        found = int(info.rank), int(info.world_size)
    except ImportError:
        found = (0, 1)
    except Exception as exc:  # a malformed cluster description must not stop single-process saves
        log.warning("could not read the cluster description (%s); assuming rank 0 of 1", exc)
        found = (0, 1)
    return (found[0] if rank is None else rank), (found[1] if world_size is None else world_size)


def broadcast(value: Any, dist: Any | None) -> Any:
    """Rank 0's ``value`` on every rank (no-op without torch.distributed)."""
    if dist is None or dist.get_world_size() == 1:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def any_rank(flag: bool, dist: Any | None) -> bool:
    """True when ``flag`` is True on any rank (an all-reduce MAX)."""
    if dist is None or dist.get_world_size() == 1:
        return flag
    import torch

    device = "cuda" if dist.get_backend() == "nccl" else "cpu"
    tensor = torch.tensor([1 if flag else 0], dtype=torch.int32, device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return bool(tensor.item())

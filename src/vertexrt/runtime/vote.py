"""Agreeing across ranks that a preemption notice arrived, one check behind, without waiting for the network.

A blocking all-reduce after every step costs a network round trip per step (hundreds of microseconds with
gloo). ``StopVote`` starts each all-reduce in the background (``async_op=True``) and reads its result at
the next check, when it has long finished: every rank sees the same answer at the same check, one check
after the notice. Without torch.distributed (or with one process) the local flag is the answer.

Example:
    >>> vote = StopVote()
    >>> vote(False)
    False
"""

from __future__ import annotations

from typing import Any

from vertexrt.checkpoint.collective import torch_dist


class StopVote:
    """``vote(local_flag) -> bool``: True on every rank from the call after any rank's flag was True.

    All ranks must call it the same number of times, at the same points (it is a collective).
    """

    def __init__(self) -> None:
        self._pending: tuple[Any, Any] | None = None  # (torch work handle, its tensor)
        self._agreed = False  # once True on every rank, no more collectives

    def __call__(self, local: bool) -> bool:
        if self._agreed:
            return True
        dist = torch_dist()
        if dist is None or dist.get_world_size() == 1:
            self._agreed = local
            return local
        if self._pending is not None:
            work, flag = self._pending
            self._pending = None
            work.wait()
            if flag.item():
                self._agreed = True
                return True
        import torch

        device = "cuda" if dist.get_backend() == "nccl" else "cpu"
        flag = torch.tensor([1 if local else 0], dtype=torch.int32, device=device)
        self._pending = (dist.all_reduce(flag, op=dist.ReduceOp.MAX, async_op=True), flag)
        return False

    def drain(self) -> None:
        """Wait for the all-reduce in flight (before the process group is destroyed)."""
        if self._pending is not None:
            work, _ = self._pending
            self._pending = None
            work.wait()

"""Agreeing across ranks that a preemption notice arrived, without waiting for the network or the GPU.

A blocking all-reduce after every step costs a network round trip per step (hundreds of microseconds with
gloo), and a CUDA flag read with ``.item()`` stalls the CPU until the GPU catches up. ``StopVote`` votes only
every ``k`` calls, with ``k`` chosen so that votes are about ``interval`` seconds apart (the ranks agree on
``k`` inside the vote itself), starts each all-reduce in the background (``async_op=True``) on CPU tensors
(a gloo side group when the job's backend is NCCL) and reads its result at the next vote, when it has long
finished. Every rank sees the same answer at the same call, at most two votes after the notice — well inside
the seconds Vertex grants between SIGTERM and SIGKILL. Without torch.distributed the local flag is the answer.

Example:
    >>> vote = StopVote()
    >>> vote(False)
    False
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from typing import Any

from vertexrt.checkpoint.collective import cpu_group, torch_dist

#: Seconds between two votes once the step time is known: the stop lands at most ~2 intervals late.
VOTE_INTERVAL = 0.1
_MAX_CALLS_BETWEEN_VOTES = 10_000


class StopVote:
    """``vote(local_flag) -> bool``: True on every rank from the same call on, once any rank's flag was True.

    All ranks must call it the same number of times, at the same points (it is a collective).
    ``reduce`` replaces torch.distributed with another blocking "any rank" reduction, asked at every call
    (e.g. a ``tf.distribute`` all-reduce for Keras under MultiWorkerMirroredStrategy).
    """

    def __init__(self, reduce: Callable[[bool], bool] | None = None, interval: float = VOTE_INTERVAL) -> None:
        self._reduce = reduce
        self._interval = interval
        self._pending: tuple[Any, Any] | None = None  # (torch work handle, its [flag, calls] tensor)
        self._agreed = False  # once True on every rank, no more collectives
        self._calls = 0
        self._next_vote = 1  # the call number of the next vote: the same on every rank
        self._every = 1  # calls between votes, as agreed by the last vote read
        self._last_vote: tuple[int, float] | None = (
            None  # (call number, monotonic time) of this rank's last vote
        )

    def __call__(self, local: bool) -> bool:
        if self._agreed:
            return True
        if self._reduce is not None:
            self._agreed = bool(self._reduce(local))
            return self._agreed
        self._calls += 1
        if self._calls < self._next_vote:  # between votes: nothing else to do on the per-step path
            return False
        dist = torch_dist()
        if dist is None or dist.get_world_size() == 1:
            self._agreed = local
            self._next_vote = self._calls + 1  # without a process group: the local flag at every call
            return local
        if self._read_pending():
            return True
        self._start(local, dist)
        self._next_vote = self._calls + self._every
        return False

    def drain(self) -> None:
        """Wait for the all-reduce in flight (before the process group is destroyed)."""
        self._read_pending()

    def _read_pending(self) -> bool:
        if self._pending is None:
            return False
        work, tensor = self._pending
        self._pending = None
        work.wait()
        stop, minus_every = (int(v) for v in tensor.tolist())
        self._every = max(1, -minus_every)
        self._agreed = bool(stop)
        return self._agreed

    def _start(self, local: bool, dist: Any) -> None:
        import torch

        now = time.monotonic()
        proposal = 1
        if self._last_vote is not None:
            calls, then = self._last_vote
            per_call = (now - then) / max(self._calls - calls, 1)
            proposal = min(_MAX_CALLS_BETWEEN_VOTES, max(1, math.ceil(self._interval / max(per_call, 1e-9))))
        self._last_vote = (self._calls, now)
        # MAX over ranks: any rank's notice stops everyone, and the smallest proposed cadence wins.
        tensor = torch.tensor([1 if local else 0, -proposal], dtype=torch.int64)
        work = dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=cpu_group(dist), async_op=True)
        self._pending = (work, tensor)


class PreemptionAgreement:
    """A SIGTERM notice agreed across ranks: one subscription to the process-wide owner plus a StopVote.

    What a framework callback needs at its step boundaries: call it at the same points on every rank;
    ``close()`` (idempotent) drains the vote and ends the subscription.

    Example:
        >>> agreement = PreemptionAgreement()
        >>> agreement()          # after each step, on every rank
        False
        >>> agreement.close()
    """

    def __init__(self) -> None:
        from vertexrt.runtime.signals import preemption_signal

        self._subscription: Any = preemption_signal().subscribe()
        self._vote: StopVote | None = StopVote()

    def __call__(self) -> bool:
        """True on every rank from the same call on, once SIGTERM arrived on any rank."""
        return self._vote is not None and self._vote(bool(self._subscription.requested))

    def close(self) -> None:
        vote, self._vote = self._vote, None
        if vote is not None:
            try:
                vote.drain()
            except Exception as exc:  # the process group may be gone already
                logging.getLogger(__name__).debug("draining the stop vote: %s", exc)
        subscription, self._subscription = self._subscription, None
        if subscription is not None:
            subscription.close()

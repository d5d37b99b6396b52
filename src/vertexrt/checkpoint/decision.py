"""Whether a ``save()`` call saves, the same answer on every rank without a collective per call.

Step-based policies (``EveryNSteps``) give the same answer on every rank, so each rank decides alone.
Anything else (a clock, a custom policy) is decided by rank 0 every ``sync_every`` calls and sent with a
non-blocking tensor broadcast that is read one call later: every rank saves at that same later call.
A clock-based save therefore lands up to ``sync_every`` calls after its moment.

Example:
    >>> from vertexrt.checkpoint import EveryNSeconds, EveryNSteps, LastSave
    >>> decide = SaveDecision(EveryNSteps(100) | EveryNSeconds(1800), world_size=1)
    >>> decide(0, LastSave(step=None, time=None, now=0.0, start_time=0.0), rank=0, dist=lambda: None)
    True
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from vertexrt.checkpoint.policies import AnySave, EveryNSteps, LastSave, SavePolicy
from vertexrt.distributed.collectives import LateBroadcast

#: Calls between two of rank 0's clock-based decisions when there is more than one rank.
SYNC_EVERY = 10


class SaveDecision:
    """``decide(step, last, rank=, dist=) -> bool``; all ranks must call it the same number of times."""

    def __init__(self, policy: SavePolicy, world_size: int, sync_every: int = SYNC_EVERY) -> None:
        parts = _parts(policy)
        self.local = [p for p in parts if isinstance(p, EveryNSteps)]
        self.chief = [p for p in parts if not isinstance(p, EveryNSteps)]
        self.world_size = world_size
        self.sync_every = sync_every
        self._calls = 0
        self._late = LateBroadcast()

    def __call__(self, step: int, last: LastSave, *, rank: int, dist: Callable[[], Any | None]) -> bool:
        """Whether ``step`` saves; ``dist()`` (torch.distributed or None) is only asked at a sync call."""
        local = any(p.should_save(step, last) for p in self.local)
        if not self.chief:
            return local
        if self.world_size == 1:
            return local or any(p.should_save(step, last) for p in self.chief)
        calls, self._calls = self._calls, self._calls + 1
        sent = self._late.result()
        chief = bool(sent[0]) if sent is not None else False
        if calls % self.sync_every == 0:
            due = rank == 0 and any(p.should_save(step, last) for p in self.chief)
            group = dist()
            if group is None or group.get_world_size() == 1:  # no process group: only rank 0 writes anyway
                return local or chief or due
            self._late.start([int(due and not (local or chief))], group)  # a save now resets the clock anyway
        return local or chief

    def drain(self) -> None:
        self._late.drain()


def _parts(policy: SavePolicy) -> list[SavePolicy]:
    if isinstance(policy, AnySave):
        return [q for p in policy.policies for q in _parts(p)]
    return [policy]

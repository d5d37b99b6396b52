"""A checkpoint manager's view of the preemption notice: its subscription and the ranks' agreement on it.

The process-wide SIGTERM owner (:mod:`vertexrt.preemption.signals`) and the cross-rank stop vote
(:mod:`vertexrt.preemption.vote`) are asked, never re-implemented here.

Example:
    >>> watch = PreemptionWatch()
    >>> watch.subscribe()
    >>> if watch.requested():   # every rank, at the same step boundaries
    ...     mgr.save(step, state, force=True)
"""

from __future__ import annotations

from typing import Any


class PreemptionWatch:
    """Whether SIGTERM arrived (here, or on any rank once the ranks agreed); the notice is subscribed to
    with :meth:`subscribe` only."""

    def __init__(self) -> None:
        self._subscription: Any = None
        self._vote: Any = None
        self.preempted = False  # the ranks agreed on a preemption: saves are synchronous from then on

    def subscribe(self) -> None:
        """Subscribe to the process-wide SIGTERM notice; idempotent."""
        if self._subscription is None:
            from vertexrt.preemption.signals import preemption_signal

            self._subscription = preemption_signal().subscribe()

    def arrived_here(self) -> bool:
        """The notice arrived in this process (subscribed only; no agreement asked)."""
        if self._subscription is None:
            return False
        from vertexrt.preemption.signals import preemption_signal

        return preemption_signal().requested

    def requested(self) -> bool:
        """True once SIGTERM arrived on any rank: every rank calls it at the same points and all see True at
        the same call (a non-blocking vote with torch.distributed, one call after the notice)."""
        if self._vote is None:
            from vertexrt.preemption.vote import StopVote

            self._vote = StopVote()
        local = self._subscription is not None and bool(self._subscription.requested)
        if self._vote(local):
            if not self.preempted and self._subscription is not None and not local:
                from vertexrt.preemption.signals import preemption_signal

                preemption_signal().request()  # decided by another rank: the same notice here
            self.preempted = True
        return self.preempted

    def drain(self) -> None:
        """Wait for the vote in flight (before the process group goes away)."""
        if self._vote is not None:
            self._vote.drain()

    def close(self) -> None:
        """Release the subscription (the original signal handlers come back with the last one)."""
        if self._subscription is not None:
            self._subscription.close()
            self._subscription = None

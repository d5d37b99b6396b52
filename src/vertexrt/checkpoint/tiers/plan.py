"""Which step the ranks restore and where each rank's state comes from: a pure function of what they hold.

Every rank all-gathers one small inventory (its own fast steps, the copies it holds per source rank, and on
rank 0 the newest durable step), so every rank computes the same :class:`RestorePlan` without further talk.

Example:
    >>> held = [Inventory(own=[5, 10], held={2: [5, 10]}, durable=None),
    ...         Inventory(own=[], held={0: [5, 10]}, durable=None),
    ...         Inventory(own=[5, 10], held={1: [5, 10]}, durable=None)]
    >>> plan(held).step, plan(held).transfers
    (10, [(2, 1)])
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Inventory:
    """One rank's fast steps (``own``), the copies it holds (``held``: source rank -> steps), and on rank 0
    the newest committed durable step."""

    own: list[int]
    held: dict[int, list[int]] = field(default_factory=dict)
    durable: int | None = None


@dataclass(frozen=True)
class RestorePlan:
    """``step`` to restore from the fast tier (None: the durable tier); ``sources[r]`` is None when rank ``r``
    reads its own copy, else the rank that sends it one; ``transfers`` the ``(sender, receiver)`` pairs."""

    step: int | None
    durable: int | None
    sources: list[int | None]

    @property
    def transfers(self) -> list[tuple[int, int]]:
        return [(sender, rank) for rank, sender in enumerate(self.sources) if sender is not None]


def plan(inventories: list[Inventory]) -> RestorePlan:
    """The newest step every rank can get, when it is not older than the newest durable step."""
    durable = inventories[0].durable if inventories else None
    where: list[dict[int, int | None]] = [{step: None for step in inv.own} for inv in inventories]
    for holder, inv in enumerate(inventories):
        for source, steps in sorted(inv.held.items()):
            if 0 <= source < len(where):
                for step in steps:
                    where[source].setdefault(step, holder)  # own copy first, then the lowest holder
    common = set.intersection(*(set(w) for w in where)) if where else set()
    newest = max(common, default=None)
    if newest is None or (durable is not None and newest < durable):
        return RestorePlan(None, durable, [])
    return RestorePlan(newest, durable, [w[newest] for w in where])

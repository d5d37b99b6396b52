"""The seeded fault schedule of ``local-run --chaos``: which fault each faulted run gets, and where.

:func:`draw` depends on the seed alone (the same seed gives the same schedule): each run gets a kind, the
kinds in an order shuffled by the seed so that any ``len(KINDS)`` consecutive runs cover every edge case,
and positions as fractions. :func:`place` turns a run's draw into faults per attempt against what the
reference run showed (its steps, epoch ends, evaluations and saves); a kind the script gives no chance
for (no evaluation, no asynchronous save) becomes a SIGTERM at the drawn step, said in ``note``.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

#: Every edge case, with what it means.
KINDS: dict[str, str] = {
    "step": "SIGTERM at a random step",
    "epoch_end": "SIGTERM on the last batch of an epoch",
    "eval": "SIGTERM during evaluation",
    "save": "SIGTERM during a synchronous checkpoint save",
    "save_async": "SIGTERM during an asynchronous checkpoint save",
    "after_resume": "SIGTERM, then again on the first step after the resume",
    "twice": "SIGTERM twice in one run, at two random steps",
    "vm_lost": "SIGKILL with no grace (a VM lost)",
    "vm_lost_disk": "SIGKILL with no grace, the replica's local disk wiped (a VM lost with its local disk)",
    "short_grace": "SIGTERM with a short grace",
    "one_replica": "SIGTERM to one replica only (the others learn of it from the stop vote)",
    "slow_steps": "SIGTERM while the step time grows",
}


@dataclass(frozen=True)
class Draw:
    """One faulted run as drawn from the seed: its kind and positions (fractions in [0, 1))."""

    kind: str
    positions: tuple[float, float]
    replica_pick: float


def draw(seed: int, runs: int) -> list[Draw]:
    """The schedule of ``runs`` faulted runs for ``seed``."""
    rng = random.Random(seed)
    kinds = list(KINDS)
    rng.shuffle(kinds)
    return [Draw(kinds[i % len(kinds)], (rng.random(), rng.random()), rng.random()) for i in range(runs)]


@dataclass(frozen=True)
class Profile:
    """What the reference run showed on its chief: steps in order, the last step of each epoch, the steps
    evaluated, and the saves (step, asynchronous)."""

    steps: int
    epoch_ends: tuple[int, ...] = ()
    evals: int = 0
    saves: tuple[tuple[int, bool], ...] = ()


@dataclass(frozen=True)
class Fault:
    """One fault of one attempt: the audit plan of the replica it lands in, who gets the notice, the
    grace, and whether the replica's local disk is lost with it."""

    plan: dict[str, Any]
    replica: str  # the label of the replica it lands in
    everyone: bool
    grace: float
    signal: str = "SIGTERM"
    wipe: bool = False


@dataclass
class Placed:
    """A faulted run: its kind, its faults by attempt (1 = the first), steps made slower, and a note."""

    kind: str
    faults: dict[int, Fault] = field(default_factory=dict)
    slow: dict[str, float] | None = None
    note: str = ""

    def describe(self) -> str:
        return KINDS[self.kind]


def _step_at(fraction: float, profile: Profile, low: int = 1) -> int:
    """A step in [low, steps - 1]: never the last (the job would be over)."""
    high = max(low, profile.steps - 1)
    return low + int(fraction * (high - low + 1))


def _term(plan: dict[str, Any], grace: float, replica: str, everyone: bool = True) -> Fault:
    return Fault({"fault": {**plan, "signal": "SIGTERM"}}, replica, everyone, grace)


def place(run: Draw, profile: Profile, *, grace: float, short_grace: float, workers: list[str]) -> Placed:
    """Faults for ``run`` against ``profile``; ``workers`` are the training replicas' labels, chief first."""
    first, second = run.positions
    step = _step_at(first, profile)
    placed = Placed(run.kind)
    chief = workers[0]
    at_step = _term({"on": "step", "at": step}, grace, chief)
    kind = run.kind
    if kind == "epoch_end":
        ends = [e for e in profile.epoch_ends if e < profile.steps]
        if ends:
            placed.faults[1] = _term({"on": "step", "at": ends[int(first * len(ends))]}, grace, chief)
        else:
            placed.note = "no epoch ended before the last step in the reference: a random step instead"
    elif kind == "eval":
        if profile.evals:
            placed.faults[1] = _term({"on": "eval", "at": 1 + int(first * profile.evals)}, grace, chief)
        else:
            placed.note = "no evaluation seen in the reference: a random step instead"
    elif kind in ("save", "save_async"):
        wanted = kind == "save_async"
        saves = [s for s, asynchronous in profile.saves if asynchronous == wanted and s < profile.steps]
        if saves:
            at = saves[int(first * len(saves))]
            placed.faults[1] = _term({"on": "save", "at": at, "asynchronous": wanted}, grace, chief)
        else:
            flavour = "asynchronous" if wanted else "synchronous"
            placed.note = f"no {flavour} save before the last step in the reference: a random step instead"
    elif kind == "after_resume":
        placed.faults[1] = at_step
        placed.faults[2] = _term({"on": "first_step"}, grace, chief)
    elif kind == "twice":
        one = _step_at(first * 0.5, profile)
        placed.faults[1] = _term({"on": "step", "at": one}, grace, chief)
        placed.faults[2] = _term({"on": "step", "at": _step_at(second, profile, low=one + 1)}, grace, chief)
    elif kind in ("vm_lost", "vm_lost_disk"):
        victim = workers[int(run.replica_pick * len(workers))]
        plan = {"fault": {"on": "step", "at": step, "signal": "SIGKILL"}}
        wipe = kind == "vm_lost_disk"
        placed.faults[1] = Fault(plan, victim, everyone=False, grace=0.0, signal="SIGKILL", wipe=wipe)
    elif kind == "short_grace":
        placed.faults[1] = _term({"on": "step", "at": step}, short_grace, chief)
    elif kind == "one_replica":
        placed.faults[1] = _term({"on": "step", "at": step}, grace, replica=workers[-1], everyone=False)
    elif kind == "slow_steps":
        start = _step_at(first * 0.5, profile)
        placed.slow = {"from": start, "by": 0.01, "max": 0.3}
        placed.faults[1] = _term({"on": "step", "at": _step_at(second, profile, low=start)}, grace, chief)
    if not placed.faults:
        placed.faults[1] = at_step
    return placed

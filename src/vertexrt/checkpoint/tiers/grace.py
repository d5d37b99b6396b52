"""The emergency save sized to the grace period: does a durable write of ``n`` bytes fit in the time left?

The durable tier's write bandwidth is observed on every durable save (:class:`WriteMeter`, the slowest of the
last few, plus their fixed cost); the grace period is ``VERTEXRT_PREEMPTION_GRACE`` seconds (default 30,
the Spot VM notice), counted from the SIGTERM, less a safety margin.

Example:
    >>> meter = WriteMeter()
    >>> meter.record(100 << 20, 2.0)          # a durable save of 100 MiB took 2 s
    >>> fits(meter.estimate(400 << 20), time_left(arrived_at=now - 5, now=now))
    True
"""

from __future__ import annotations

import os
from collections import deque

from vertexrt.errors import ConfigError

GRACE_VARIABLE = "VERTEXRT_PREEMPTION_GRACE"
#: Seconds between the preemption notice and the hard kill on a Spot VM.
DEFAULT_GRACE = 30.0
#: Of the grace period, this fraction (and at least MARGIN_SECONDS) is kept back for exiting.
MARGIN_FRACTION = 0.1
MARGIN_SECONDS = 1.0
#: Durable writes remembered for the estimate.
HISTORY = 5


def grace_seconds() -> float:
    """``VERTEXRT_PREEMPTION_GRACE`` (seconds), else :data:`DEFAULT_GRACE`.

    Raises:
        ConfigError: the variable is not a positive number.
    """
    raw = os.environ.get(GRACE_VARIABLE, "").strip()
    if not raw:
        return DEFAULT_GRACE
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value > 0 or value == float("inf"):
        raise ConfigError(
            f"{GRACE_VARIABLE}={raw!r}: give the grace period in seconds, e.g. 30 (Spot) or 120"
        )
    return value


def time_left(arrived_at: float | None, now: float, grace: float | None = None) -> float:
    """Seconds still usable for writing: the grace since ``arrived_at`` (now when unknown) less the
    margin."""
    grace = grace_seconds() if grace is None else grace
    spent = 0.0 if arrived_at is None else max(0.0, now - arrived_at)
    return grace - spent - max(MARGIN_SECONDS, MARGIN_FRACTION * grace)


class WriteMeter:
    """Observed durable writes: ``(bytes, seconds)`` of the last :data:`HISTORY` saves."""

    def __init__(self) -> None:
        self.writes: deque[tuple[int, float]] = deque(maxlen=HISTORY)

    def record(self, nbytes: int, seconds: float) -> None:
        if nbytes > 0 and seconds > 0:
            self.writes.append((nbytes, seconds))

    def estimate(self, nbytes: int) -> float | None:
        """Seconds a durable write of ``nbytes`` is expected to take (the slowest observed rate), or None
        before any durable write was observed."""
        if not self.writes:
            return None
        return max(seconds * nbytes / max(1, written) for written, seconds in self.writes)


def fits(estimate: float | None, left: float) -> bool:
    """Whether a write expected to take ``estimate`` seconds fits in ``left`` (unknown: it is tried, since
    a durable step becomes visible only once complete)."""
    return left > 0 and (estimate is None or estimate <= left)

"""When to save and which checkpoints to keep: small policies with one method each, combined with ``|``.

Save policies answer ``should_save(step, last)``; keep policies answer ``keep(checkpoints)`` with one flag
per checkpoint. ``a | b`` saves (or keeps) when either does. The newest committed checkpoint is always kept
by the manager, whatever the keep policy says.

A policy can also learn: :class:`YoungDaly` spaces durable saves by the observed save cost and time between
failures. The manager reports each durable write's duration to the parts of its save policy that have an
``observe_save(seconds)`` method (:func:`observe_save_cost`); the runtime reports the mean time between
failures to those with ``observe_mtbf(seconds, failures)`` (:func:`observers`).

Example:
    >>> save = EveryNSteps(1000) | EveryNSeconds(1800)
    >>> keep = KeepLast(3) | KeepEveryNSteps(10_000) | KeepBest("val_loss", "min")
    >>> save = YoungDaly(minimum=300, maximum=3 * 3600) | EveryNSteps(50_000)
"""

from __future__ import annotations

import logging
import math
import os
import threading
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, runtime_checkable

from vertexrt.errors import ConfigError

log = logging.getLogger(__name__)

MTBF_VARIABLE = "VERTEXRT_MTBF"
#: The mean time between failures assumed before any is observed (and without ``VERTEXRT_MTBF``).
DEFAULT_MTBF = 24 * 3600.0
#: Durable saves averaged for the save cost.
SAVE_HISTORY = 5
#: A new interval is logged when it differs from the one logged last by more than this fraction.
LOG_CHANGE = 0.2


@dataclass(frozen=True)
class CheckpointInfo:
    """A committed checkpoint as the keep policies see it."""

    step: int
    time: float
    metrics: Mapping[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class LastSave:
    """What the save policies know about the previous save (``step``/``time`` are None before the first)."""

    step: int | None
    time: float | None
    now: float
    start_time: float


@runtime_checkable
class SavePolicy(Protocol):
    """Decides whether ``step`` is saved."""

    def should_save(self, step: int, last: LastSave) -> bool: ...


@runtime_checkable
class KeepPolicy(Protocol):
    """Marks which committed checkpoints (sorted by step, oldest first) to keep."""

    def keep(self, checkpoints: Sequence[CheckpointInfo]) -> list[bool]: ...


class _SaveOr:
    def __or__(self, other: SavePolicy) -> AnySave:
        return AnySave((self, other))  # type: ignore[arg-type]


class _KeepOr:
    def __or__(self, other: KeepPolicy) -> AnyKeep:
        return AnyKeep((self, other))  # type: ignore[arg-type]


@dataclass(frozen=True)
class EveryNSteps(_SaveOr):
    """Save when ``step`` is a multiple of ``n`` (``EveryNSteps(1)``: every call)."""

    n: int

    def __post_init__(self) -> None:
        _positive("EveryNSteps", "n", self.n)

    def should_save(self, step: int, last: LastSave) -> bool:
        return step % self.n == 0 and step != last.step


@dataclass(frozen=True)
class EveryNSeconds(_SaveOr):
    """Save when ``seconds`` have passed since the previous save (or since the manager started)."""

    seconds: float

    def __post_init__(self) -> None:
        _positive("EveryNSeconds", "seconds", self.seconds)

    def should_save(self, step: int, last: LastSave) -> bool:
        since = last.time if last.time is not None else last.start_time
        return last.now - since >= self.seconds and step != last.step


@dataclass(frozen=True)
class AnySave(_SaveOr):
    """Save when any of ``policies`` says so."""

    policies: tuple[SavePolicy, ...]

    def should_save(self, step: int, last: LastSave) -> bool:
        return any(p.should_save(step, last) for p in self.policies)

    def __or__(self, other: SavePolicy) -> AnySave:
        return AnySave((*self.policies, other))


class YoungDaly(_SaveOr):
    """Save when the optimum interval between checkpoints has passed since the previous save (Young/Daly).

    The interval is Daly's (2006) optimum for a save cost ``C`` and a mean time between failures ``M``:
    ``sqrt(2*C*M) * (1 + sqrt(C/2M)/3 + (C/2M)/9) - C`` when ``C < 2M``, else ``M`` (to first order Young's
    (1974) ``sqrt(2*C*M)``), clamped to ``[minimum, maximum]`` seconds. Observations win over the starting
    values:

    - ``C``: the mean duration of the last :data:`SAVE_HISTORY` durable writes, which the manager reports
      (for an async save, the background write: the bandwidth a save costs); before the first,
      ``save_seconds``; with neither, the interval is ``minimum``, so the first durable save comes early and
      measures it.
    - ``M``: the job's uptime per failure that ``@vertexrt.main``'s context reads from rank 0's attempt log
      (``<checkpoint dir>/attempts/``: attempts that raised or hung; preemptions add uptime, not failures, as
      the save at the notice loses nothing); with no failure recorded, ``mtbf_seconds``, else
      ``VERTEXRT_MTBF`` (seconds), else :data:`DEFAULT_MTBF` (24 h). A VM lost without notice leaves no
      record: where that is common, give your fleet's ``mtbf_seconds``.

    The interval is logged when it first applies and whenever it moves by more than :data:`LOG_CHANGE`.

    Raises:
        ConfigError: a value is not a positive number, ``maximum < minimum``, or ``VERTEXRT_MTBF`` is bad.
    """

    def __init__(
        self,
        save_seconds: float | None = None,
        mtbf_seconds: float | None = None,
        *,
        minimum: float = 60.0,
        maximum: float = 4 * 3600.0,
    ) -> None:
        for name, value in (("save_seconds", save_seconds), ("mtbf_seconds", mtbf_seconds)):
            if value is not None:
                _seconds(name, value)
        _seconds("minimum", minimum)
        _seconds("maximum", maximum)
        if maximum < minimum:
            raise ConfigError(
                f"YoungDaly(minimum={minimum!r}, maximum={maximum!r}): maximum must be >= minimum"
            )
        self.save_seconds, self.mtbf_seconds = save_seconds, mtbf_seconds
        self.minimum, self.maximum = float(minimum), float(maximum)
        self._saves: deque[float] = deque(maxlen=SAVE_HISTORY)
        self._observed_mtbf: tuple[float, int] | None = None
        self._lock = threading.Lock()  # observe_save runs on the manager's writer thread
        self._logged: float | None = None
        self.mtbf()  # a bad VERTEXRT_MTBF fails here, not at the first save

    def __repr__(self) -> str:
        return (
            f"YoungDaly(save_seconds={self.save_seconds!r}, mtbf_seconds={self.mtbf_seconds!r}, "
            f"minimum={self.minimum!r}, maximum={self.maximum!r})"
        )

    def observe_save(self, seconds: float) -> None:
        """A durable save took ``seconds`` (the manager calls it after each durable write)."""
        if seconds > 0 and math.isfinite(seconds):
            with self._lock:
                self._saves.append(float(seconds))

    def observe_mtbf(self, seconds: float, failures: int) -> None:
        """The job's mean time between failures is ``seconds``, over ``failures`` observed failures."""
        if seconds > 0 and math.isfinite(seconds) and failures > 0:
            self._observed_mtbf = (float(seconds), failures)

    def cost(self) -> float | None:
        """``C``: the mean of the observed durable saves, else ``save_seconds`` (None: unknown)."""
        with self._lock:
            saves = list(self._saves)
        return sum(saves) / len(saves) if saves else self.save_seconds

    def mtbf(self) -> float:
        """``M``: observed, else ``mtbf_seconds``, else ``VERTEXRT_MTBF``, else :data:`DEFAULT_MTBF`."""
        return self._mtbf()[0]

    def interval(self) -> float:
        """Seconds between durable saves now (``minimum`` while the save cost is unknown)."""
        cost = self.cost()
        if cost is None:
            return self.minimum
        return min(self.maximum, max(self.minimum, daly_interval(cost, self.mtbf())))

    def should_save(self, step: int, last: LastSave) -> bool:
        interval = self.interval()
        if self._logged is None or abs(interval - self._logged) > LOG_CHANGE * self._logged:
            self._logged = interval
            log.info("%s", self._describe(interval))
        since = last.time if last.time is not None else last.start_time
        return last.now - since >= interval and step != last.step

    def _mtbf(self) -> tuple[float, str]:
        if self._observed_mtbf is not None:
            seconds, failures = self._observed_mtbf
            return seconds, f"over {failures} failure(s) in the attempt log"
        if self.mtbf_seconds is not None:
            return float(self.mtbf_seconds), "mtbf_seconds"
        raw = os.environ.get(MTBF_VARIABLE, "").strip()
        if not raw:
            return DEFAULT_MTBF, f"the default; set {MTBF_VARIABLE} to change it"
        try:
            value = float(raw)
        except ValueError:
            value = math.nan
        if not (value > 0 and math.isfinite(value)):
            raise ConfigError(
                f"{MTBF_VARIABLE}={raw[:40]!r}: give the mean time between failures in seconds, e.g. 86400"
            )
        return value, MTBF_VARIABLE

    def _describe(self, interval: float) -> str:
        cost = self.cost()
        mtbf, source = self._mtbf()
        if cost is None:
            return (
                f"durable checkpoint interval {interval:.0f} s (YoungDaly: the minimum until the first "
                "durable save measures its cost)"
            )
        with self._lock:
            saves = len(self._saves)
        measured = f"mean of {saves} durable save(s)" if saves else "save_seconds"
        return (
            f"durable checkpoint interval {interval:.0f} s (YoungDaly: save cost {cost:.1f} s, {measured}; "
            f"mean time between failures {mtbf:.0f} s, {source}; "
            f"within [{self.minimum:g}, {self.maximum:g}] s)"
        )


def daly_interval(cost: float, mtbf: float) -> float:
    """Daly's (2006) optimum seconds between checkpoints that each cost ``cost``, failures every ``mtbf``."""
    if cost >= 2 * mtbf:
        return mtbf
    ratio = cost / (2 * mtbf)
    return math.sqrt(2 * cost * mtbf) * (1 + math.sqrt(ratio) / 3 + ratio / 9) - cost


def parts(policy: SavePolicy) -> list[SavePolicy]:
    """The policies ``policy`` combines (itself when it combines none), nested ``|`` flattened."""
    if isinstance(policy, AnySave):
        return [q for p in policy.policies for q in parts(p)]
    return [policy]


def observers(policy: SavePolicy, method: str) -> list[Any]:
    """The parts of ``policy`` that have a callable ``method`` (e.g. ``"observe_mtbf"``)."""
    return [p for p in parts(policy) if callable(getattr(p, method, None))]


def observe_save_cost(policy: SavePolicy, seconds: float) -> None:
    """Tell the parts of ``policy`` that learn from save costs that a durable save took ``seconds``."""
    for part in observers(policy, "observe_save"):
        part.observe_save(seconds)


@dataclass(frozen=True)
class KeepLast(_KeepOr):
    """Keep the newest ``n`` checkpoints."""

    n: int

    def __post_init__(self) -> None:
        _positive("KeepLast", "n", self.n)

    def keep(self, checkpoints: Sequence[CheckpointInfo]) -> list[bool]:
        cut = len(checkpoints) - self.n
        return [i >= cut for i in range(len(checkpoints))]


@dataclass(frozen=True)
class KeepEveryNSteps(_KeepOr):
    """Keep every checkpoint whose step is a multiple of ``n`` (a thinned-out history)."""

    n: int

    def __post_init__(self) -> None:
        _positive("KeepEveryNSteps", "n", self.n)

    def keep(self, checkpoints: Sequence[CheckpointInfo]) -> list[bool]:
        return [c.step % self.n == 0 for c in checkpoints]


@dataclass(frozen=True)
class KeepBest(_KeepOr):
    """Keep the ``n`` best checkpoints by ``metric`` (``mode`` "min" or "max"); ones without it: not kept."""

    metric: str
    mode: Literal["min", "max"] = "min"
    n: int = 1

    def __post_init__(self) -> None:
        _positive("KeepBest", "n", self.n)
        if self.mode not in ("min", "max"):
            raise ConfigError(f"KeepBest(mode={self.mode!r}): mode must be 'min' or 'max'")

    def keep(self, checkpoints: Sequence[CheckpointInfo]) -> list[bool]:
        sign = 1.0 if self.mode == "min" else -1.0
        scored = []
        for i, c in enumerate(checkpoints):
            value = c.metrics.get(self.metric)
            if isinstance(value, (int, float)) and not math.isnan(value):
                scored.append((sign * float(value), -c.step, i))
        best = {i for _, _, i in sorted(scored)[: self.n]}
        return [i in best for i in range(len(checkpoints))]


@dataclass(frozen=True)
class AnyKeep(_KeepOr):
    """Keep a checkpoint when any of ``policies`` keeps it."""

    policies: tuple[KeepPolicy, ...]

    def keep(self, checkpoints: Sequence[CheckpointInfo]) -> list[bool]:
        flags = [False] * len(checkpoints)
        for policy in self.policies:
            flags = [a or b for a, b in zip(flags, policy.keep(checkpoints), strict=True)]
        return flags

    def __or__(self, other: KeepPolicy) -> AnyKeep:
        return AnyKeep((*self.policies, other))


def _seconds(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (0 < value < math.inf):
        raise ConfigError(f"YoungDaly({name}={value!r}): give a number of seconds > 0")


def _positive(cls: str, name: str, value: float) -> None:
    if not value > 0:
        raise ConfigError(f"{cls}({name}={value!r}): {name} must be > 0")

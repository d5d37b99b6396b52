"""When to save and which checkpoints to keep: small policies with one method each, combined with ``|``.

Save policies answer ``should_save(step, last)``; keep policies answer ``keep(checkpoints)`` with one flag
per checkpoint. ``a | b`` saves (or keeps) when either does. The newest committed checkpoint is always kept
by the manager, whatever the keep policy says.

Example:
    >>> save = EveryNSteps(1000) | EveryNSeconds(1800)
    >>> keep = KeepLast(3) | KeepEveryNSteps(10_000) | KeepBest("val_loss", "min")
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal, Protocol, runtime_checkable

from vertexrt.errors import ConfigError


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


def _positive(cls: str, name: str, value: float) -> None:
    if not value > 0:
        raise ConfigError(f"{cls}({name}={value!r}): {name} must be > 0")

"""The Trainer's evaluation metrics: what ``evaluate()`` returned, weighted by counts, averaged over ranks.

``evaluate()`` returns ``{"name": value}`` or ``{"name": (value, count)}``; each rank's value is weighted by
its count (e.g. the examples it scored; by default the batches it iterated) in the mean over all ranks.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from vertexrt.errors import ConfigError


def weighted(metrics: Mapping[str, Any], default_count: int) -> dict[str, tuple[float, float]]:
    """``{name: (value, count)}`` from what ``evaluate()`` returned."""
    pairs = {}
    for name, given in metrics.items():
        if isinstance(given, tuple):
            if len(given) != 2:
                raise ConfigError(
                    f"evaluate() returned {name!r}: {given!r}; give a number or a (value, count) pair"
                )
            value, count = given
        else:
            value, count = given, default_count
        if float(count) < 0:
            raise ConfigError(f"evaluate() returned {name!r} with count {count!r}; a count must be >= 0")
        pairs[name] = (float(value), float(count))
    return pairs


def average_over_ranks(pairs: dict[str, tuple[float, float]], dist: Any) -> dict[str, float]:
    """The count-weighted mean of each metric over all ranks: one all-gather through ``dist`` (a
    torch.distributed module, or None for one process); NaN where every count is 0."""
    from vertexrt.distributed.collectives import all_gather

    totals: dict[str, list[float]] = {}
    for rank_metrics in all_gather(pairs, dist):
        for name, (value, count) in rank_metrics.items():
            total = totals.setdefault(name, [0.0, 0.0])
            if count > 0:
                total[0] += value * count
                total[1] += count
    return {name: s / c if c > 0 else math.nan for name, (s, c) in totals.items()}

"""Who reads what: replicas x DataLoader workers -> virtual readers, and each reader's share of an epoch.

Reader ``v = rank * num_workers + worker`` of ``V = world_size * num_workers``. The epoch's unit order (files,
or BigQuery row ranges) is shuffled by ``(seed, epoch)``; with at least ``V`` units reader ``v`` takes
units ``v, v+V, ...`` (file level). With fewer files than readers each uncompressed file is first cut
into pieces (:func:`pieces`: byte ranges for CSV, JSONL and uncompressed TFRecord, whole row groups for
Parquet), about 4 per reader, so a reader reads about its share of the bytes; only when there are still
fewer units it reads them all and keeps records ``g % V == v`` of the concatenated stream (record-level
striding). When record counts are
known (``equalize=``) each reader instead takes a contiguous ``1/V`` slice of the record stream
(:func:`balanced`). Every record goes to exactly one reader.

That contiguous layout is elastic: a mid-epoch state becomes a *plan* (the intervals of the epoch's record
order not yet read, :func:`remaining`) that any number of readers shares out afresh, as mosaicml
streaming's canonical order does.

Example:
    >>> plan = Topology(rank=1, world_size=3, worker=0, num_workers=2)
    >>> plan.reader, plan.readers
    (2, 6)
"""

from __future__ import annotations

import logging
import random
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from vertexrt.errors import ConfigError

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Topology:
    """One reader's place among all readers of the job."""

    rank: int = 0
    world_size: int = 1
    worker: int = 0
    num_workers: int = 1

    @property
    def reader(self) -> int:
        return self.rank * self.num_workers + self.worker

    @property
    def readers(self) -> int:
        return self.world_size * self.num_workers


@dataclass(frozen=True)
class Unit:
    """A contiguous part of a source: a whole file, a piece of a file (the records that begin in bytes
    ``[start, end)``, or Parquet rows), rows ``[start, end)`` of a table, or with ``records`` the records
    ``[start, end)`` of the file part ``[at, until)`` (counted from its first record)."""

    source: int
    start: int = 0
    end: int | None = None
    records: bool = False
    at: int = 0
    until: int | None = None


def replica(rank: int | None = None, world_size: int | None = None) -> tuple[int, int]:
    """``(rank, world_size)``: the arguments, else torch.distributed when initialised, else the cluster model.

    Raises:
        ConfigError: only one of the two is given, or rank is outside ``[0, world_size)``.
    """
    if (rank is None) != (world_size is None):
        raise ConfigError(
            f"pass both rank and world_size, or neither (got rank={rank}, world_size={world_size})"
        )
    if rank is None or world_size is None:
        rank, world_size = _detected_replica()
    if world_size < 1 or not 0 <= rank < world_size:
        raise ConfigError(
            f"rank={rank} is not in [0, world_size={world_size}): fix the rank/world_size arguments"
        )
    return int(rank), int(world_size)


def _detected_replica() -> tuple[int, int]:
    from vertexrt.distributed import world_info

    info = world_info()
    if info.rank < 0:  # an evaluator (or ps): outside the training world, it reads the whole dataset
        return 0, 1
    return info.rank, info.world_size


def dataloader_worker() -> tuple[int, int]:
    """``(worker id, num_workers)`` inside a torch DataLoader worker process, else ``(0, 1)``."""
    if "torch.utils.data" not in sys.modules:
        return 0, 1
    from torch.utils.data import get_worker_info

    info = get_worker_info()
    return (info.id, info.num_workers) if info is not None else (0, 1)


def epoch_order(units: Sequence[Unit], seed: int, epoch: int, shuffle: bool) -> list[Unit]:
    """The epoch's unit order: as given, or shuffled by ``(seed, epoch)`` (same in every process)."""
    order = list(units)
    if shuffle:
        random.Random(f"vertexrt-units/{seed}/{epoch}").shuffle(order)
    return order


def assign(order: Sequence[Unit], reader: int, readers: int) -> tuple[list[Unit], int, int]:
    """``(units, stride, offset)`` for ``reader``: it keeps raw record ``g`` of its stream iff
    ``g % stride == offset``."""
    if len(order) >= readers:
        return list(order[reader::readers]), 1, 0
    return list(order), readers, reader


Interval = tuple[int, int]


def share(plan: Sequence[Sequence[int]], reader: int, readers: int) -> list[Interval]:
    """Reader ``reader``'s contiguous ``1/readers`` of ``plan``: the epoch's records still to read, as
    ``[start, end)`` intervals of the epoch's deterministic record order (shares differ by at most one).

    Example:
        >>> share([(0, 4), (6, 10)], 1, 2)
        [(6, 10)]
    """
    total = sum(end - start for start, end in plan)
    low, high = total * reader // readers, total * (reader + 1) // readers
    out, base = [], 0
    for start, end in plan:
        first, last = max(low, base), min(high, base + end - start)
        if first < last:
            out.append((start + first - base, start + last - base))
        base += end - start
    return out


def remaining(plan: Sequence[Sequence[int]], readers: int, consumed: Mapping[int, int]) -> list[Interval]:
    """What is left of ``plan`` after reader ``r`` of ``readers`` consumed the first ``consumed[r]`` records
    of its :func:`share`: the plan any number of readers continues from (each record still read once).

    Example:
        >>> remaining([(0, 10)], 2, {0: 2, 1: 5})
        [(2, 5)]
    """
    out: list[Interval] = []
    for reader in range(readers):
        left = consumed.get(reader, 0)
        for start, end in share(plan, reader, readers):
            skip = min(left, end - start)
            left -= skip
            if start + skip < end:
                if out and out[-1][1] == start + skip:
                    out[-1] = (out[-1][0], end)
                else:
                    out.append((start + skip, end))
    return out


def balanced(
    order: Sequence[Unit],
    unit_counts: Sequence[int],
    reader: int,
    readers: int,
    plan: Sequence[Sequence[int]] | None = None,
) -> list[Unit]:
    """Reader ``reader``'s :func:`share` of ``plan`` (default: the whole epoch stream) as record ranges of
    files: shares differ by at most one record (needs the per-unit record counts)."""
    units = []
    for low, high in share(plan or [(0, sum(unit_counts))], reader, readers):
        base = 0
        for unit, count in zip(order, unit_counts, strict=True):
            first, last = max(low, base), min(high, base + count)
            if first < last:
                units.append(Unit(unit.source, first - base, last - base, True, unit.start, unit.end))
            base += count
    return units


def pieces(sizes: Sequence[int], parts: int) -> list[int]:
    """How many pieces each file is cut into so that there are about ``parts`` in all, in proportion to
    size (at least one each).

    Example:
        >>> pieces([100, 300], 8)
        [2, 6]
    """
    total = sum(sizes) or 1
    return [max(1, round(parts * size / total)) for size in sizes]


def reader_counts(order: Sequence[Unit], unit_counts: Sequence[int], readers: int) -> list[int]:
    """How many records each reader gets in an epoch with this unit order."""
    if len(order) >= readers:
        return [sum(unit_counts[i] for i in range(r, len(order), readers)) for r in range(readers)]
    total = sum(unit_counts)
    return [total // readers + (1 if r < total % readers else 0) for r in range(readers)]


def equalized(counts: Sequence[int], how: str | None, batch_size: int) -> int | None:
    """The per-reader record target: ``"drop_remainder"`` -> the smallest share, ``"pad"`` -> the largest,
    rounded to a multiple of ``batch_size`` (down for drop, up for pad); None for no equalizing."""
    if how is None:
        return None
    if how == "drop_remainder":
        return (min(counts) // batch_size) * batch_size
    if how == "pad":
        return -(-max(counts) // batch_size) * batch_size
    raise ConfigError(f"equalize={how!r}: use 'auto', 'drop_remainder', 'pad' or None ('off')")

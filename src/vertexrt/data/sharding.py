"""Who reads what: replicas x DataLoader workers -> virtual readers, and each reader's share of an epoch.

Reader ``v = rank * num_workers + worker`` of ``V = world_size * num_workers``. The epoch's unit order (files,
or BigQuery row ranges) is shuffled by ``(seed, epoch)``; with at least ``V`` units reader ``v`` takes
units ``v, v+V, ...`` (file level), with fewer it reads them all and keeps records ``g % V == v`` of the
concatenated stream (record-level striding). When record counts are known (``equalize=``) each reader
instead takes a contiguous ``1/V`` slice of the record stream (:func:`balanced`). Every record goes to
exactly one reader.

Example:
    >>> plan = Topology(rank=1, world_size=3, worker=0, num_workers=2)
    >>> plan.reader, plan.readers
    (2, 6)
"""

from __future__ import annotations

import logging
import random
import sys
from collections.abc import Sequence
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
    """A contiguous part of a source: a whole file, rows ``[start, end)`` of a table, or with ``records``
    the records ``[start, end)`` of a file (counted from its first record)."""

    source: int
    start: int = 0
    end: int | None = None
    records: bool = False


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


def balanced(order: Sequence[Unit], unit_counts: Sequence[int], reader: int, readers: int) -> list[Unit]:
    """Reader ``reader``'s contiguous slice ``[N*r/R, N*(r+1)/R)`` of the epoch's record stream, as record
    ranges of files: shares differ by at most one record (needs the per-unit record counts)."""
    total = sum(unit_counts)
    low, high = total * reader // readers, total * (reader + 1) // readers
    units = []
    base = 0
    for unit, count in zip(order, unit_counts, strict=True):
        first, last = max(low, base), min(high, base + count)
        if first < last:
            units.append(Unit(unit.source, first - base, last - base, records=True))
        base += count
    return units


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
    raise ConfigError(f"equalize={how!r}: use None, 'drop_remainder' or 'pad'")

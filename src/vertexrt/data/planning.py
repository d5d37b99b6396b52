"""Epoch planning: the units an epoch reads (files, file pieces, table streams or row ranges) in their
seeded order, each reader's share of them, and the record counts that ``equalize`` and contiguous shares
need.

What is read comes from a :class:`UnitSource`: :class:`FileUnits` for data files here, and
:class:`~vertexrt.data.table_session.TableSession` for a BigQuery table (its read session's streams).
A dataset talks to either through that protocol only.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from vertexrt.data.counting import CountCache, Key, cache_dir, count_alone, count_together, data_key
from vertexrt.data.cursor import StreamSpec, state_problem
from vertexrt.data.formats.base import Errors, FileSource, Format
from vertexrt.data.sharding import (
    Topology,
    Unit,
    assign,
    balanced,
    epoch_order,
    equalized,
    pieces,
    reader_counts,
    share,
)
from vertexrt.errors import DataError
from vertexrt.phases import long_phase

Intervals = list[tuple[int, int]]


@dataclass(frozen=True)
class PlanContext:
    """What a plan depends on beyond its data: this process's place and the epoch being planned."""

    topology: Topology
    readers: int
    """The readers of the job as planned: replicas x the DataLoader workers of each."""
    epoch: int
    mid_epoch: bool
    """A loaded state positions readers inside the epoch."""
    equalizing: bool
    """``equalize`` is in force."""
    in_loader_worker: bool
    """This process is a torch DataLoader worker (no collective can run here)."""


class UnitSource(Protocol):
    """What a dataset reads, as units an epoch plan orders and shares out."""

    elastic: bool
    """A state over it can move to another number of readers (contiguous shares of counted units)."""

    def units(self, context: PlanContext, readers: int) -> list[Unit]:
        """The epoch's units for ``readers`` readers, unordered."""
        ...

    def cut(self, order: list[Unit], readers: int) -> list[Unit]:
        """``order`` with units cut into pieces so that ``readers`` readers each read about their share."""
        ...

    def counts(self, units: Sequence[Unit], context: PlanContext, shared: bool) -> list[int]:
        """Records in each of ``units``; ``shared``: every rank asks at the same point (counting may be
        split between the ranks and gathered)."""
        ...

    def total(self, context: PlanContext) -> int:
        """Records in the whole source."""
        ...

    def contiguous(self, context: PlanContext, unread: Intervals | None, readers: int) -> bool:
        """Each of ``readers`` readers takes a contiguous share of the epoch's counted records (else whole
        units, strided)."""
        ...

    def reading(self, units: list[Unit]) -> list[Unit]:
        """A reader's contiguous share as its format reads it."""
        ...

    def read_sources(self, context: PlanContext) -> Sequence[Any]:
        """The sources that units index."""
        ...

    def identity(self) -> Any:
        """What the data is, for the state's fingerprint (JSON-serializable)."""
        ...

    def summary(self) -> tuple[str, str | None]:
        """``(files, versions)`` of a state's options: a short description, a hash of the file versions."""
        ...

    def names(self) -> list[str]:
        """The data's names without their directory (the data audit's identity)."""
        ...

    def uris(self) -> list[str]:
        """The data files (none for a table)."""
        ...

    def title(self) -> str:
        """What the data is, in a few words ("3 files", a table id)."""
        ...

    def prepare(self, context: PlanContext) -> None:
        """The shared work before DataLoader workers fork (a table's read session), in a rank's main
        process; every rank calls it at the same point."""
        ...

    def new_epoch(self, context: PlanContext) -> None:
        """An epoch was selected (a table's session about to expire is renewed here, before workers start)."""
        ...

    def state_fields(self) -> dict[str, Any]:
        """What a data state keeps of how the data is read (a table's read ``session``)."""
        ...

    def checked(self, state: dict[str, Any]) -> dict[str, Any] | None:
        """A loaded state's record of how the data was read (see :meth:`state_fields`), checked against
        this source, or None."""
        ...

    def load(self, record: dict[str, Any] | None, epoch: int, mid_epoch: bool, equalizing: bool) -> None:
        """Read as a loaded state's checked record says."""
        ...

    def plan_record(self) -> dict[str, Any] | None:
        """How the data is read now, for DataLoader workers to :meth:`follow` (None: nothing to share)."""
        ...

    def follow(self, record: dict[str, Any] | None) -> None:
        """Read as ``record`` (a :meth:`plan_record` made in the DataLoader's parent) says."""
        ...


class FileUnits:
    """Data files: each file a unit, cut into byte pieces when there are fewer files than readers; record
    counts by reading (or the format's metadata) once per job (:mod:`vertexrt.data.counting`: shared out
    between the ranks, cached by the data's fingerprint), kept for the life of the dataset."""

    elastic = True

    def __init__(self, files: Sequence[FileSource], fmt: Format, columnar: bool, errors: Errors):
        self.files = files
        self.format = fmt
        self.columnar = columnar
        self.errors = errors
        self.known: dict[Key, int] = {}  # records per (file, start, end)
        self.gathered: set[Key] = set()  # the keys counted together with every rank (the same on each)

    def units(self, context: PlanContext, readers: int) -> list[Unit]:
        return [Unit(i) for i in range(len(self.files))]

    def cut(self, order: list[Unit], readers: int) -> list[Unit]:
        if len(order) >= readers:
            return order
        files = [self.files[unit.source] for unit in order]
        out = []
        for unit, source, parts in zip(
            order, files, pieces([f.size for f in files], 4 * readers), strict=True
        ):
            cut = self.format.split(source, parts, self.columnar) if parts > 1 else None
            out.extend([Unit(unit.source, a, b) for a, b in cut] if cut else [unit])
        return out

    def counts(self, units: Sequence[Unit], context: PlanContext, shared: bool) -> list[int]:
        keys = list(dict.fromkeys((u.source, u.start, u.end) for u in units))
        dist = _group(context) if shared else None
        if dist is not None:  # every rank is here: count together (the same keys on every rank)
            wanted = [key for key in keys if key not in self.gathered]
            if wanted:
                sizes = [self._bytes(key) for key in wanted]
                self.known.update(
                    count_together(wanted, sizes, self._count, dist, self._cache(), self._describe)
                )
                self.gathered.update(wanted)
        else:
            missing = [key for key in keys if key not in self.known]
            if missing:  # a DataLoader worker reads the cache but leaves writing it to the ranks
                self.known.update(
                    count_alone(missing, self._count, self._cache(), write=not context.in_loader_worker)
                )
        return [self.known[(u.source, u.start, u.end)] for u in units]

    def _count(self, key: Key) -> int:
        if key in self.known:  # counted here before (alone): no need to read it again
            return self.known[key]
        index, start, end = key
        source = self.files[index]
        if end is None:
            return self.format.count(source, self.errors)
        return self.format.count_piece(source, start, end, self.errors)

    def _bytes(self, key: Key) -> int:
        index, start, end = key
        return (end - start) if end is not None else self.files[index].size

    def _describe(self, key: Key) -> str:
        index, start, end = key
        uri = self.files[index].uri
        return uri if end is None else f"{uri} (bytes {start} to {end})"

    def _cache(self) -> CountCache | None:
        directory = cache_dir()
        if directory is None:
            return None
        return CountCache(directory, data_key(self.files, self.format, self.errors.on_error, self.columnar))

    def total(self, context: PlanContext) -> int:
        with long_phase("counting records"):  # here alone: count() may be called on one rank only
            return sum(self.counts([Unit(i) for i in range(len(self.files))], context, shared=False))

    def contiguous(self, context: PlanContext, unread: Intervals | None, readers: int) -> bool:
        return context.equalizing or unread is not None

    def reading(self, units: list[Unit]) -> list[Unit]:
        return units

    def read_sources(self, context: PlanContext) -> Sequence[Any]:
        return self.files

    def identity(self) -> Any:
        return [(s.uri, s.size, s.version) for s in self.files]

    def summary(self) -> tuple[str, str | None]:
        import hashlib

        files = f"{len(self.files)} files of {sum(s.size for s in self.files)} bytes"
        return files, hashlib.sha1("\n".join(s.version for s in self.files).encode()).hexdigest()[:12]

    def names(self) -> list[str]:
        return [s.uri.rsplit("/", 1)[-1] for s in self.files]

    def uris(self) -> list[str]:
        return [s.uri for s in self.files]

    def title(self) -> str:
        return f"{len(self.files)} files"

    def prepare(self, context: PlanContext) -> None:
        return None

    def new_epoch(self, context: PlanContext) -> None:
        return None

    def state_fields(self) -> dict[str, Any]:
        return {}

    def checked(self, state: dict[str, Any]) -> dict[str, Any] | None:
        return None

    def load(self, record: dict[str, Any] | None, epoch: int, mid_epoch: bool, equalizing: bool) -> None:
        return None

    def plan_record(self) -> dict[str, Any] | None:
        return None

    def follow(self, record: dict[str, Any] | None) -> None:
        return None


def _group(context: PlanContext) -> Any | None:
    """The process group to count together in: ``torch.distributed`` of this dataset's ranks (several),
    outside DataLoader workers (a collective from a worker would wait for ranks that never join it)."""
    from vertexrt.distributed.collectives import torch_dist

    dist = torch_dist()
    topo = context.topology
    if dist is None or context.in_loader_worker or topo.world_size == 1:
        return None
    if dist.get_world_size() != topo.world_size or dist.get_rank() != topo.rank:
        return None  # ranks given by hand, not the group's: count here
    return dist


def epoch_units(
    source: UnitSource, context: PlanContext, readers: int, seed: int, shuffle: bool
) -> list[Unit]:
    """The epoch's unit order: units shuffled by ``(seed, epoch)``; with fewer files than readers each file
    that can be split is cut into pieces, in file order (about 4 per reader in all), so a reader reads
    about its share of the bytes and the record order is the same however files are cut."""
    return source.cut(epoch_order(source.units(context, readers), seed, context.epoch, shuffle), readers)


def counted(source: UnitSource, units: Sequence[Unit], context: PlanContext) -> list[int]:
    """Records in each of ``units``, counted (shared between the ranks, every rank calling it at the same
    point) before an epoch's first record: a phase that may take long, not a hang."""
    with long_phase("counting records"):
        return source.counts(units, context, shared=True)


def within(unread: Intervals | None, total: int) -> Intervals:
    """The epoch's unread intervals (``unread``, default all ``total`` records), refused if a loaded plan
    reaches past the records there are."""
    if unread is None:
        return [(0, total)]
    if unread and unread[-1][1] > total:
        raise DataError(state_problem("plan", unread[-1], f"reaches past the epoch's {total} records"))
    return unread


@dataclass(frozen=True)
class ReadOptions:
    """The dataset options a reader's spec carries."""

    fmt: Format
    equalize: str | None
    batch_size: int
    block_size: int
    seed: int
    columnar: bool


def reader_spec(
    source: UnitSource,
    context: PlanContext,
    order: list[Unit],
    unread: Intervals | None,
    options: ReadOptions,
) -> StreamSpec:
    """Everything reader ``context.topology.reader`` needs to read its share of the epoch in ``order``:
    a contiguous share of the counted records (equalized, or an elastic plan's ``unread`` intervals), or
    whole units strided over the readers (counted only when equalizing)."""
    topo = context.topology
    target = None
    mode = options.equalize
    if source.contiguous(context, unread, topo.readers):
        unit_counts = counted(source, order, context)
        plan = within(unread, sum(unit_counts))
        units = source.reading(balanced(order, unit_counts, topo.reader, topo.readers, plan))
        stride, offset = 1, 0
        counts = [sum(b - a for a, b in share(plan, r, topo.readers)) for r in range(topo.readers)]
        target = equalized(counts, mode, options.batch_size)
    else:
        units, stride, offset = assign(order, topo.reader, topo.readers)
        if mode is not None:
            counts = reader_counts(order, counted(source, order, context), topo.readers)
            target = equalized(counts, mode, options.batch_size)
    return StreamSpec(
        fmt=options.fmt,
        sources=source.read_sources(context),
        units=units,
        stride=stride,
        offset=offset,
        pad_units=order,
        target=target,
        block_size=options.block_size,
        seed=options.seed,
        epoch=context.epoch,
        reader=topo.reader,
        readers=topo.readers,
        columnar=options.columnar,
    )

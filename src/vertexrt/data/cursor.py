"""The reader's position and the chunk stream that produces records from it.

A :class:`Cursor` is O(1): the phase (own share / padding / done), the unit index, a position inside the
unit (byte offset or row) plus a count of raw records to skip from there, the stream index ``g`` used by
record striding, the shuffle block number, how many records of the current block were already consumed
(``drop``), and how many records came before.

Shuffling is a permutation of consecutive blocks of ``block_size`` kept records, seeded by
``(seed, epoch, reader, readers, block)``. The cursor holds the block's start, so resuming re-reads that
one block, permutes it identically, and drops what was consumed: no buffer is ever saved.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, fields, replace
from typing import Any

from vertexrt.data.columns import concat, take
from vertexrt.data.formats.base import Errors, Format
from vertexrt.data.sharding import Unit
from vertexrt.errors import DataError

OWN, PAD, DONE = 0, 1, 2


@dataclass(frozen=True)
class Cursor:
    """Where one reader is in its epoch. ``pos=None`` means the start of the unit."""

    phase: int = OWN
    unit: int = 0
    pos: int | None = None
    skip: int = 0
    g: int = 0
    block: int = 0
    drop: int = 0
    emitted: int = 0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Any, where: str = "cursor") -> Cursor:
        """The cursor saved as ``data``, every field checked: integers ``>= 0`` (``pos`` may be None), a
        known phase.

        Raises:
            DataError: naming the field (``where``: e.g. ``cursors['3']``), when the state was damaged or
                edited.
        """
        if not isinstance(data, dict):
            raise DataError(f"{state_problem(where, data, 'is not an object of cursor fields')}")
        names = {f.name for f in fields(cls)}
        unknown = set(data) - names
        if unknown:
            raise DataError(
                f"data reader state has unknown cursor fields {sorted(unknown)}: not a vertexrt state"
            )
        for name, value in data.items():
            if not (name == "pos" and value is None):
                check_count(f"{where}.{name}", value)
        if data.get("phase", OWN) not in (OWN, PAD, DONE):
            raise DataError(state_problem(f"{where}.phase", data["phase"], f"is not {OWN}, {PAD} or {DONE}"))
        return cls(**data)

    @property
    def consumed(self) -> int:
        """Records this reader has delivered in the epoch."""
        return self.emitted + self.drop


@dataclass
class Chunk:
    """Raw records ready for the consumer (decoded as they are handed out), where they came from, and
    what is needed to turn "c of them consumed" into a cursor."""

    records: list[Any]
    start: Cursor
    stride: int
    shuffled: bool
    origins: list[
        tuple[Any, int]
    ]  # (source, position) of the reads the records came from, for error messages

    def cursor_after(self, consumed: int) -> Cursor:
        if self.shuffled:
            return replace(self.start, drop=self.start.drop + consumed)
        return replace(
            self.start, skip=self.start.skip + consumed * self.stride, emitted=self.start.emitted + consumed
        )


@dataclass
class StreamSpec:
    """Everything a reader needs to produce its epoch (picklable)."""

    fmt: Format
    sources: Sequence[Any]
    units: list[Unit]
    stride: int
    offset: int
    pad_units: list[Unit]
    target: int | None
    block_size: int
    seed: int
    epoch: int
    reader: int
    readers: int
    columnar: bool = False


Kept = tuple[int, int, int, int, list[Any], Any]

MAX_COUNT = 1 << 62
"""Largest position or count a saved state may hold (larger is damage, not data)."""


def state_problem(field: str, value: Any, problem: str) -> str:
    """The message for a data state field that cannot be used, and what to do about it."""
    return (
        f"data state field {field}={str(value)[:80]!r} {problem}: the state was damaged or edited, or "
        "belongs to other data; restore the state exactly as state_dict() returned it, or leave it out "
        "(don't call load_state_dict) to start the epoch afresh"
    )


def check_count(field: str, value: Any) -> int:
    """``value`` when it is an integer in ``[0, MAX_COUNT]`` (not a bool), else a DataError naming
    ``field``."""
    if type(value) is not int or not 0 <= value <= MAX_COUNT:
        raise DataError(state_problem(field, value, f"is not an integer from 0 to {MAX_COUNT}"))
    return value


def check_against(spec: StreamSpec, cursor: Cursor, reader: int) -> None:
    """Refuse a loaded cursor that ``spec`` (this reader's epoch) cannot hold: a unit past its units, a
    count past its record target, a shuffle block's consumed records past the block size."""
    where = f"cursors['{reader}']"
    units = spec.units if cursor.phase == OWN else spec.pad_units
    if cursor.unit > len(units):
        raise DataError(
            state_problem(f"{where}.unit", cursor.unit, f"is past this reader's {len(units)} units")
        )
    if spec.target is not None and cursor.emitted > spec.target:
        raise DataError(
            state_problem(f"{where}.emitted", cursor.emitted, f"is past this reader's {spec.target} records")
        )
    if cursor.drop > max(spec.block_size, 1):
        raise DataError(
            state_problem(f"{where}.drop", cursor.drop, f"is past the shuffle block of {spec.block_size}")
        )


def _kept(
    spec: StreamSpec, units: list[Unit], stride: int, offset: int, start: Cursor, errors: Errors
) -> Iterator[Kept]:
    """``(unit, pos, first, g at pos, raws, source)``: raw ``j`` of the list is raw number
    ``first + j * stride`` counted from the read position ``pos`` (several chunks may share a position)."""
    fmt = spec.fmt
    g = start.g  # stream index (or, in a record-range unit, file record index) of the next raw
    for ui in range(start.unit, len(units)):
        unit = units[ui]
        source = spec.sources[unit.source]
        resumed = ui == start.unit and start.pos is not None
        ranged = unit.records  # records [unit.start, unit.end) of a file; g counts the file's records
        if ranged:
            pos, skip, g = (start.pos, start.skip, start.g) if resumed else (unit.at, unit.start, 0)
        else:
            pos, skip = (start.pos if resumed else unit.start), (start.skip if ui == start.unit else 0)
        assert pos is not None
        group_pos, group_g, base = -1, g, 0
        read = fmt.read_columns if spec.columnar else fmt.read
        checking = resumed  # a loaded position: it must hold the records its skip counts
        for cpos, raws in read(source, pos, unit.until if ranged else unit.end, errors):
            if cpos != group_pos:
                if checking and group_pos >= 0 and skip >= max(stride, 1):
                    _past_end(source, start)
                checking = checking and group_pos < 0
                group_pos, group_g, base = cpos, g, 0
            n = len(raws)
            if skip >= n:
                skip -= n
            else:
                k, skip = skip, 0
                if ranged:
                    assert unit.end is not None
                    picked = raws[k : min(n, unit.end - g)]
                else:
                    if stride > 1:
                        k += (offset - (g + k)) % stride
                    picked = raws[k::stride] if stride > 1 else (raws[k:] if k else raws)
                if picked:
                    yield ui, cpos, base + k, group_g, picked, source
            base += n
            g += n
            if ranged and unit.end is not None and g >= unit.end:
                break
        if checking and (group_pos < 0 or skip >= max(stride, 1)):
            _past_end(source, start)


def _past_end(source: Any, cursor: Cursor) -> None:
    """A loaded cursor's position (``pos``, then ``skip`` records) is past what the source holds there."""
    where = getattr(source, "uri", source)
    raise DataError(
        state_problem("cursor (pos, skip)", (cursor.pos, cursor.skip), f"points past the records of {where}")
    )


def chunks(spec: StreamSpec, cursor: Cursor, errors: Errors) -> Iterator[Chunk]:
    """The reader's chunks from ``cursor`` to the end of its epoch (own share, then padding if any)."""
    emitted = cursor.emitted
    target = spec.target
    if cursor.phase == DONE:
        return
    if cursor.phase == OWN:
        kept = _kept(spec, spec.units, spec.stride, spec.offset, cursor, errors)
        produced = (
            _shuffled(spec, kept, cursor) if spec.block_size > 1 else _plain(kept, OWN, spec.stride, emitted)
        )
        for chunk in produced:
            before = chunk.start.emitted + (chunk.start.drop if chunk.shuffled else 0)
            if target is not None:
                if before >= target:
                    return
                chunk.records = chunk.records[: target - before]
            emitted = before + len(chunk.records)
            if chunk.records:
                yield chunk
        if target is None or emitted >= target:
            return
        cursor = Cursor(phase=PAD, emitted=emitted)
    if target is not None:
        yield from _padding(spec, cursor, target, errors)


def _plain(kept: Iterator[Kept], phase: int, stride: int, emitted: int, passes: int = 0) -> Iterator[Chunk]:
    for ui, cpos, k, g, raws, source in kept:
        yield Chunk(raws, Cursor(phase, ui, cpos, k, g, passes, 0, emitted), stride, False, [(source, cpos)])
        emitted += len(raws)


def _shuffled(spec: StreamSpec, kept: Iterator[Kept], cursor: Cursor) -> Iterator[Chunk]:
    import numpy as np

    size = spec.block_size
    stride = spec.stride
    block = cursor.block
    drop = cursor.drop
    emitted = cursor.emitted
    buf: list[Any] = []  # pieces (lists of raws, or Columns) holding ``have`` records
    have = 0
    origins: list[tuple[Any, int]] = []
    head = (0, 0, 0, 0)

    def emit() -> Chunk:
        nonlocal block, drop, emitted
        order = np.random.default_rng([spec.seed, spec.epoch, spec.reader, spec.readers, block]).permutation(
            have
        )
        records = take(concat(buf), order)
        start = Cursor(OWN, head[0], head[1], head[2], head[3], block, drop, emitted)
        chunk = Chunk(records[drop:] if drop else records, start, stride, True, origins)
        emitted += have
        block += 1
        drop = 0
        return chunk

    try:
        for ui, cpos, k, g, raws, source in kept:
            i = 0
            while i < len(raws):
                if not have:
                    head = (ui, cpos, k + i * stride, g)
                piece = raws[i : i + size - have]
                buf.append(piece)
                have += len(piece)
                origins.append((source, cpos))
                i += len(piece)
                if have == size:
                    yield emit()
                    buf, origins, have = [], [], 0
    except DataError:  # damaged data: hand out the records read before it, then raise
        if have:
            yield emit()
        raise
    if have:
        yield emit()


def _padding(spec: StreamSpec, cursor: Cursor, target: int, errors: Errors) -> Iterator[Chunk]:
    """Records repeated from the start of the whole epoch stream until ``target`` is reached."""
    emitted = cursor.emitted
    passes = cursor.block
    start = cursor
    while emitted < target:
        fresh = start.unit == 0 and start.pos is None and start.skip == 0
        for chunk in _plain(_kept(spec, spec.pad_units, 1, 0, start, errors), PAD, 1, emitted, passes):
            chunk.records = chunk.records[: target - emitted]
            emitted += len(chunk.records)
            yield chunk
            if emitted >= target:
                return
        if fresh and emitted == start.emitted:
            return  # a whole pass gave nothing: there is nothing to repeat
        passes += 1
        start = Cursor(PAD, block=passes, emitted=emitted)

"""The record-format protocol every reader implements, and the error policy they share.

A format turns one *source* (a file, or a BigQuery table) into chunks of raw records, ``(position, raws)``,
where ``position`` is where ``raws[0]`` starts: a byte offset (in the decompressed stream) for files, a row
index for Parquet and BigQuery. Starting a read at a position a chunk reported, and skipping ``k`` raw
records, lands on the same record whatever the chunk boundaries were — that is what makes a cursor exact.
``decode`` turns the raws that this reader keeps into records (dicts, bytes).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

from vertexrt.errors import DataError

logger = logging.getLogger(__name__)

OnError = Literal["raise", "skip"]


@dataclass(frozen=True)
class FileSource:
    """One data file: a URI that :func:`vertexrt.paths.open` accepts, its size in bytes, and its version
    when listed (the Cloud Storage generation, or the local modification time; "" when unknown)."""

    uri: str
    size: int
    version: str = ""


class Errors:
    """What to do with a malformed record: raise :class:`~vertexrt.errors.DataError`, or skip and count."""

    def __init__(self, on_error: OnError = "raise"):
        if on_error not in ("raise", "skip"):
            raise DataError(f"on_error={on_error!r}: use 'raise' or 'skip'")
        self.on_error = on_error
        self.skipped = 0

    def bad(self, message: str) -> None:
        """Report a malformed record: raises with ``on_error='raise'``, else logs and counts it."""
        if self.on_error == "raise":
            raise DataError(message + "; or pass on_error='skip' to skip and count bad records")
        self.skipped += 1
        logger.warning("skipping bad record: %s", message)


class Format:
    """Base class of record formats. Subclasses are small, picklable option holders."""

    name: ClassVar[str] = ""
    one_record_per_source: ClassVar[bool] = False
    """Each source is one record: the epoch's shuffled source order is a full shuffle (no record buffer)."""

    def for_sources(self, sources: Any) -> Format:
        """This format completed from the dataset's sources (e.g. the class names of :class:`Files`)."""
        return self

    def read(
        self, source: Any, start: int, end: int | None, errors: Errors
    ) -> Iterator[tuple[int, list[Any]]]:
        """Chunks ``(position, raws)`` from ``start`` (a position this format reported, or 0).

        ``position`` is where ``raws[0]`` starts, or — when it repeats the previous chunk's position — the
        chunk continues the previous one (a format may hand out one read in several batches).
        """
        raise NotImplementedError

    def read_columns(
        self, source: Any, start: int, end: int | None, errors: Errors
    ) -> Iterator[tuple[int, Any]]:
        """Like :meth:`read`, with each chunk's records as one :class:`~vertexrt.data.columns.Columns`
        (``columnar=True``); positions follow this method's own scheme, consistent with itself."""
        raise DataError(
            f"the {type(self).__name__} format has no columnar reader: use Parquet, CSV or JSONL files, or "
            "open the dataset with columnar=False"
        )

    def decoder(self) -> Callable[[Any], Any] | None:
        """The function that turns one raw record into a record as it is handed out (None: as is).

        Decoding happens record by record in the consuming thread, so shuffle buffers hold compact raw
        records and decoded objects die young (cheap for the garbage collector).
        """
        return None

    def ignorable(self, raw: Any) -> bool:
        """True for a raw record that failed to decode but is no record at all (a whitespace-only line)."""
        return False

    def describe(self, raw: Any, origins: list[tuple[Any, int]], error: Exception) -> str:
        """Where and why ``raw`` (from one of the reads in ``origins``) failed to decode."""
        where = getattr(origins[0][0], "uri", origins[0][0]) if origins else "?"
        return f"{where}: bad record near position {origins[0][1] if origins else '?'}: {error}"

    def count(self, source: Any, errors: Errors) -> int:
        """Number of records in ``source`` (reads it unless the format has metadata)."""
        return sum(len(raws) for _, raws in self.read(source, 0, None, errors))

    def split(self, source: Any, parts: int, columnar: bool) -> list[tuple[int, int]] | None:
        """``source`` cut into about ``parts`` pieces ``(start, end)`` that :meth:`read` takes (a byte range
        holds the records that begin in it), or None: it is read whole (compressed, or no split reader)."""
        return None

    def count_piece(self, source: Any, start: int, end: int, errors: Errors) -> int:
        """Number of records in the piece ``[start, end)`` of ``source`` (from :meth:`split`)."""
        return sum(len(raws) for _, raws in self.read(source, start, end, errors))

    def __repr__(self) -> str:
        fields = ", ".join(f"{k}={_show(v)}" for k, v in vars(self).items())
        return f"{type(self).__name__}({fields})"

    def __eq__(self, other: object) -> bool:
        return type(self) is type(other) and vars(self) == vars(other)

    def __hash__(self) -> int:
        return hash((type(self).__name__, repr(self)))


MIN_PIECE_BYTES = 1 << 20
"""Smallest byte range a file is cut into for several readers (a smaller one costs more in requests)."""


def byte_pieces(size: int, parts: int) -> list[tuple[int, int]] | None:
    """``[0, size)`` cut into ``parts`` equal byte ranges of at least :data:`MIN_PIECE_BYTES`; None for one.

    Example:
        >>> byte_pieces(4 << 20, 2)
        [(0, 2097152), (2097152, 4194304)]
    """
    parts = min(parts, size // MIN_PIECE_BYTES)
    if parts <= 1:
        return None
    return [(size * j // parts, size * (j + 1) // parts) for j in range(parts)]


def _show(value: Any) -> str:
    """A repr that is the same in every process (functions by name, not address)."""
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k!r}: {_show(v)}" for k, v in value.items()) + "}"
    if callable(value) and hasattr(value, "__qualname__"):
        return f"{getattr(value, '__module__', '')}.{value.__qualname__}"
    return repr(value)

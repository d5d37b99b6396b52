"""Parquet files streamed by row group and record batch (pyarrow); positions are row indices.

A file of several row groups is cut into pieces of whole row groups for several readers
(:meth:`Parquet.split`); a reader reads only the footer and its row groups' column chunks. A Cloud Storage
object is read by range requests (:class:`~vertexrt.data._ranged.RangedFile`), each under the storage
deadline and retry policy of :mod:`vertexrt.retries` (``VERTEXRT_STORAGE_TIMEOUT``): a stalled connection
ends as a :class:`~vertexrt.errors.DataError` naming the file, never a hang.

Example:
    >>> ds = vertexrt.data.open_dataset("gs://b/table/*.parquet", format=Parquet(columns=["x", "y"]))
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Iterator, Sequence
from typing import Any

from vertexrt.data._ranged import RangedFile
from vertexrt.data.formats.base import Errors, FileSource, Format
from vertexrt.errors import DataError

ROW_SLICE = 1024
"""Rows the row path turns into dicts at a time (a whole record batch's dicts alive at once cost more)."""


class _NotParquet(DataError):
    """The file's bytes are not Parquet: a bad record (skipped with ``on_error="skip"``), not an outage."""


class Parquet(Format):
    """Parquet rows as dicts.

    Args:
        columns: the columns to read (default all).
        batch_rows: rows per record batch read.
    """

    name = "parquet"

    def __init__(self, columns: Sequence[str] | None = None, batch_rows: int = 8192):
        self.columns = list(columns) if columns is not None else None
        self.batch_rows = batch_rows

    def _open(self, source: FileSource) -> tuple[Any, Any]:
        """The open file and its ``pyarrow.parquet.ParquetFile`` (the footer read).

        Raises:
            _NotParquet: the bytes are not a Parquet file.
            DataError: Cloud Storage failed or stalled past the deadline (not skipped as a bad record).
        """
        import pyarrow as pa
        import pyarrow.parquet as pq

        from vertexrt import paths

        fs, path = paths.filesystem(source.uri)
        if paths.is_local_filesystem(fs):
            # Let Arrow's own reader open the path (much faster than a Python file object).
            f: Any = open(path, "rb")  # noqa: SIM115
            arrow_file: Any = path
        else:
            f = RangedFile(fs, path, source.uri, source.size)
            arrow_file = pa.PythonFile(f, mode="r")
        try:
            return f, pq.ParquetFile(arrow_file)
        except (pa.ArrowInvalid, OSError) as err:
            f.close()
            raise _NotParquet(f"{source.uri}: not a readable Parquet file ({err})") from None
        except BaseException:
            f.close()
            raise

    def read(
        self, source: FileSource, start: int, end: int | None, errors: Errors
    ) -> Iterator[tuple[int, list[dict[str, Any]]]]:
        """Rows from row ``start``, in lists of at most ``ROW_SLICE`` at their first row's index (fewer row
        dicts alive at once): an unreadable row group is a bad record (raise, or skip the group and count
        it) after every row before it was handed out."""
        for pos, batch in self._batches(source, start, end, errors):
            for at in range(0, batch.num_rows, ROW_SLICE):
                yield pos + at, batch.slice(at, ROW_SLICE).to_pylist()

    def read_columns(
        self, source: FileSource, start: int, end: int | None, errors: Errors
    ) -> Iterator[tuple[int, Any]]:
        """:meth:`read` as column batches (row positions, the same as :meth:`read`)."""
        from vertexrt.data.columns import Columns

        for pos, batch in self._batches(source, start, end, errors):
            yield pos, Columns(batch, source.uri)

    def split(self, source: FileSource, parts: int, columnar: bool) -> list[tuple[int, int]] | None:
        """Row ranges of whole row groups, about ``parts`` of them with about equal rows; None for a file of
        one row group (or an unreadable one: reading it reports why)."""
        try:
            groups = _row_groups(source)
        except _NotParquet:
            return None
        parts = min(parts, len(groups))
        if parts <= 1:
            return None
        total, cuts, first = sum(groups), [0], 0
        for rows in groups[:-1]:
            first += rows
            if first * parts >= total * len(cuts) and len(cuts) < parts:
                cuts.append(first)
        cuts.append(total)
        return [(a, b) for a, b in itertools.pairwise(cuts) if a < b]

    def count_piece(self, source: FileSource, start: int, end: int, errors: Errors) -> int:
        return end - start  # whole row groups: from the footer

    def _batches(
        self, source: FileSource, start: int, end: int | None, errors: Errors
    ) -> Iterator[tuple[int, Any]]:
        opened = self._opened(source, errors)
        if opened is None:
            return
        f, pf = opened
        try:
            meta = pf.metadata
            first_row = 0
            for index in range(meta.num_row_groups):
                if end is not None and first_row >= end:
                    return
                rows = meta.row_group(index).num_rows
                if first_row + rows > start:
                    yield from self._group(source, pf, index, first_row, rows, start, end, errors)
                first_row += rows
        finally:
            f.close()

    def _group(
        self,
        source: FileSource,
        pf: Any,
        index: int,
        first_row: int,
        rows: int,
        start: int,
        end: int | None,
        errors: Errors,
    ) -> Iterator[tuple[int, Any]]:
        import pyarrow as pa

        pos = first_row
        try:
            for batch in pf.iter_batches(
                batch_size=self.batch_rows, row_groups=[index], columns=self.columns
            ):
                at = pos
                pos += batch.num_rows
                if end is not None and pos > end:  # a piece ends inside this batch
                    batch = batch.slice(0, max(0, end - at))
                if at + batch.num_rows > start:
                    yield max(at, start), (batch if at >= start else batch.slice(start - at))
                if end is not None and pos >= end:
                    return
        except (OSError, pa.ArrowException) as err:
            errors.bad(
                f"{source.uri}: row group {index} (rows {first_row}-{first_row + rows - 1}) is unreadable "
                f"from row {pos}: {err}; re-copy or rewrite the file"
            )

    def _opened(self, source: FileSource, errors: Errors) -> tuple[Any, Any] | None:
        """The open file, or None for a zero-byte file (no rows) or, with ``on_error="skip"``, a file that
        is not Parquet (counted)."""
        if source.size == 0:
            return None
        try:
            return self._open(source)
        except _NotParquet as err:
            errors.bad(str(err))
            return None

    def count(self, source: FileSource, errors: Errors) -> int:
        opened = self._opened(source, Errors(errors.on_error))  # counted once, when it is read
        if opened is None:
            return 0
        f, pf = opened
        try:
            return int(pf.metadata.num_rows)
        finally:
            f.close()


@functools.lru_cache(maxsize=256)  # read once per file, not once per reader and epoch
def _row_groups(source: FileSource) -> tuple[int, ...]:
    """Rows per row group of ``source``, from its footer."""
    if source.size == 0:
        return ()
    f, pf = Parquet()._open(source)
    try:
        meta = pf.metadata
        return tuple(meta.row_group(i).num_rows for i in range(meta.num_row_groups))
    finally:
        f.close()

"""Parquet files streamed by row group and record batch (pyarrow); positions are row indices.

Example:
    >>> ds = vertexrt.data.open_dataset("gs://b/table/*.parquet", format=Parquet(columns=["x", "y"]))
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

from vertexrt.data._io import GCS_BLOCK_SIZE
from vertexrt.data.formats import Errors, FileSource, Format
from vertexrt.errors import DataError


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
        import pyarrow as pa
        import pyarrow.parquet as pq

        from vertexrt import paths

        fs, path = paths.filesystem(source.uri)
        local = "file" in (fs.protocol if isinstance(fs.protocol, tuple) else (fs.protocol,))
        # Local files: let Arrow's own reader open the path (much faster than a Python file object).
        f = open(path, "rb") if local else paths.open(source.uri, "rb", block_size=GCS_BLOCK_SIZE)  # noqa: SIM115
        try:
            return f, pq.ParquetFile(path if local else f)
        except (pa.ArrowInvalid, OSError) as err:
            f.close()
            raise DataError(f"{source.uri}: not a readable Parquet file ({err})") from None

    def read(
        self, source: FileSource, start: int, end: int | None, errors: Errors
    ) -> Iterator[tuple[int, list[dict[str, Any]]]]:
        f, pf = self._open(source)
        try:
            meta = pf.metadata
            first_row = 0
            groups: list[int] = []
            for index in range(meta.num_row_groups):
                rows = meta.row_group(index).num_rows
                if groups or first_row + rows > start:
                    groups.append(index)
                else:
                    first_row += rows
            if not groups:
                return
            pos = first_row
            for batch in pf.iter_batches(batch_size=self.batch_rows, row_groups=groups, columns=self.columns):
                rows = batch.to_pylist()
                if pos < start:
                    rows = rows[start - pos :]
                    here = start
                else:
                    here = pos
                pos += batch.num_rows
                if rows:
                    yield here, rows
        finally:
            f.close()

    def count(self, source: FileSource, errors: Errors) -> int:
        f, pf = self._open(source)
        try:
            return int(pf.metadata.num_rows)
        finally:
            f.close()

"""CSV with a header row (RFC 4180 quoting, quoted newlines included), plain or GZIP/ZLIB-compressed.

Values are strings unless ``types`` maps a column to a converter; an empty typed value becomes None.

Example:
    >>> ds = vertexrt.data.open_dataset("gs://b/training-*.csv", format=CSV(types={"age": int, "y": float}))
"""

from __future__ import annotations

import csv as _csv
import functools
import io
import itertools
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from vertexrt.data._io import MAX_RECORD_BYTES, compression_for
from vertexrt.data.formats._lines import last_record_end, line_at, line_chunks, locate, next_record_end
from vertexrt.data.formats.base import Errors, FileSource, Format, byte_pieces
from vertexrt.errors import DataError

_BATCH = 256


class CSV(Format):
    """CSV rows as dicts keyed by the header.

    Args:
        types: column -> converter (``int``, ``float``, ``bool``, any callable taking the string).
        delimiter: field separator (``"\\t"`` for TSV).
        columns: column names when the files have no header row.
        compression: ``"GZIP"``, ``"ZLIB"`` or ``""``; default from the extension.
        max_record_bytes: a longer record (or field) is a bad record, refused before it is buffered
            (default 256 MiB); a stray quote that swallows the rest of a file ends there. Python's
            ``csv.field_size_limit`` is raised to it when lower.
    """

    name = "csv"

    def __init__(
        self,
        types: dict[str, Callable[[str], Any]] | None = None,
        delimiter: str = ",",
        columns: Sequence[str] | None = None,
        compression: str | None = None,
        max_record_bytes: int = MAX_RECORD_BYTES,
    ):
        self.types = dict(types or {})
        self.delimiter = delimiter
        self.columns = list(columns) if columns is not None else None
        self.compression = compression
        self.max_record_bytes = int(max_record_bytes)

    def read(
        self, source: FileSource, start: int, end: int | None, errors: Errors
    ) -> Iterator[tuple[int, list[tuple[tuple[str, ...], list[str]]]]]:
        uri = source.uri
        compression = compression_for(uri, self.compression)
        header = None if start == 0 and self.columns is None else self.header(source)
        if _csv.field_size_limit() < self.max_record_bytes:
            _csv.field_size_limit(self.max_record_bytes)  # a field is never longer than its record
        chunks = line_chunks(
            uri, compression, start, errors, limit=self.max_record_bytes, end=end, file_size=source.size
        )
        for pos, body in chunks:
            for text in _texts(uri, compression, pos, body, errors):
                rows = filter(None, _csv.reader(io.StringIO(text, newline=""), delimiter=self.delimiter))
                if header is None:
                    first = next(rows, None)
                    if first is None:
                        continue
                    header = tuple(first)
                    blank = len(body) - len(body.lstrip(b"\r\n"))
                    stop = body.find(b"\n", blank)  # header rows do not hold quoted newlines
                    pos += len(body) + 1 if stop < 0 else stop + 1
                # Parsed lazily, a batch at a time from the same position: parsed rows are GC-tracked
                # objects, and a whole read's worth alive at once makes the collector crawl.
                while batch := [(header, row) for row in itertools.islice(rows, _BATCH)]:
                    yield pos, batch

    def read_columns(
        self, source: FileSource, start: int, end: int | None, errors: Errors
    ) -> Iterator[tuple[int, Any]]:
        """Column batches by pyarrow's CSV reader; ``types`` of ``int``, ``float``, ``str`` or ``bool``
        fix a column's type, the others are inferred by Arrow. Positions count rows from the file start."""
        import pyarrow as pa
        import pyarrow.csv as pacsv

        from vertexrt.data.columns import ARROW_BLOCK, arrow_text_batches

        arrow_types = {int: pa.int64(), float: pa.float64(), str: pa.string(), bool: pa.bool_()}
        column_types = {}
        for name, convert in self.types.items():
            if convert not in arrow_types:
                raise DataError(
                    f"CSV(types={{{name!r}: {_show_type(convert)}}}): the columnar reader takes int, float, "
                    "str or "
                    "bool; convert that column after reading, or open the dataset with columnar=False"
                )
            column_types[name] = arrow_types[convert]

        def open_reader(f: Any) -> Any:
            return pacsv.open_csv(
                f,
                read_options=pacsv.ReadOptions(column_names=self.columns, block_size=ARROW_BLOCK),
                parse_options=pacsv.ParseOptions(delimiter=self.delimiter, newlines_in_values=True),
                convert_options=pacsv.ConvertOptions(column_types=column_types),
            )

        if source.size:
            yield from arrow_text_batches(
                source.uri, compression_for(source.uri, self.compression), open_reader, errors
            )

    def split(self, source: FileSource, parts: int, columnar: bool) -> list[tuple[int, int]] | None:
        """Byte ranges of an uncompressed file (row path only: columnar positions count rows)."""
        if columnar or compression_for(source.uri, self.compression):
            return None
        return byte_pieces(source.size, parts)

    def header(self, source: FileSource) -> tuple[str, ...]:
        """The column names of ``source`` (its first record, or ``columns``)."""
        if self.columns is not None:
            return tuple(self.columns)
        return _header(
            source, compression_for(source.uri, self.compression), self.delimiter, self.max_record_bytes
        )

    def decoder(self) -> Callable[[tuple[tuple[str, ...], list[str]]], dict[str, Any]]:
        types = list(self.types.items())

        def plain(raw: tuple[tuple[str, ...], list[str]]) -> dict[str, Any]:
            return dict(zip(raw[0], raw[1], strict=True))  # a wrong column count raises ValueError

        def typed(raw: tuple[tuple[str, ...], list[str]]) -> dict[str, Any]:
            record: dict[str, Any] = dict(zip(raw[0], raw[1], strict=True))
            for name, convert in types:
                value = record.get(name)
                if value is not None:
                    try:
                        record[name] = convert(value) if value != "" else None
                    except (TypeError, ValueError) as err:
                        raise DataError(
                            f"column {name!r} value {value!r} cannot be converted: {err}"
                        ) from None
            return record

        return typed if types else plain

    def describe(
        self, raw: tuple[tuple[str, ...], list[str]], origins: list[tuple[FileSource, int]], error: Exception
    ) -> str:
        delimiter = self.delimiter

        def parse(line: bytes) -> list[str]:
            return next(_csv.reader([line.decode("utf-8", errors="replace")], delimiter=delimiter), [])

        def same_row(line: bytes) -> bool:
            return parse(line) == raw[1]

        def starts_row(
            line: bytes,
        ) -> bool:  # the first line of a row that swallowed newlines (a stray quote)
            parsed = parse(line)
            return (
                0 < len(parsed) <= len(row)
                and parsed[:-1] == row[: len(parsed) - 1]
                and (row[len(parsed) - 1].startswith(parsed[-1]))
            )

        header, row = raw
        if len(row) != len(header):
            error = DataError(
                f"CSV row has {len(row)} columns, the header has {len(header)} ({list(header)})"
            )
        for matches in (same_row, starts_row):
            for source, position in origins:
                found = locate(source.uri, compression_for(source.uri, self.compression), position, matches)
                if found is not None:
                    return f"{source.uri}:{found[0]} (byte {found[1]}): {error}"
        return f"{origins[0][0].uri}: row {str(row)[:200]}: {error}"


def _show_type(convert: Any) -> str:
    return getattr(convert, "__qualname__", repr(convert))


def _texts(uri: str, compression: str, pos: int, body: bytes, errors: Errors) -> Iterator[str]:
    """``body`` as text; a record that is not UTF-8 is reported to ``errors`` and the records around it
    are still handed out."""
    while body:
        try:
            yield body.decode("utf-8")
            return
        except UnicodeDecodeError as err:
            begin = last_record_end(body[: err.start], 0, 0) + 1  # the bad record starts here
            if begin:
                yield body[: begin - 1].decode("utf-8")
            stop = next_record_end(body, err.start, body.count(b'"', begin, err.start) & 1)
            line = line_at(uri, compression, pos + begin)
            errors.bad(
                f"{uri}:{line} (byte {pos + begin}): byte {pos + err.start} is not UTF-8 ({err.reason})"
            )
            if stop < 0:
                return
            pos, body = pos + stop + 1, body[stop + 1 :]


@functools.lru_cache(maxsize=64)  # read once per file, not once per piece of it
def _header(source: FileSource, compression: str, delimiter: str, limit: int) -> tuple[str, ...]:
    errors = Errors("raise")
    for end in (None,) if compression else (1, None):  # the first record, else the first non-blank
        lines = line_chunks(source.uri, compression, 0, errors, limit=limit, end=end, file_size=source.size)
        for _, body in lines:
            text = body.decode("utf-8", errors="replace")
            for row in _csv.reader(io.StringIO(text, newline=""), delimiter=delimiter):
                if row:
                    return tuple(row)
    raise DataError(f"{source.uri}: the CSV file is empty (no header row); pass CSV(columns=[...])")

"""CSV with a header row (RFC 4180 quoting, quoted newlines included), plain or GZIP/ZLIB-compressed.

Values are strings unless ``types`` maps a column to a converter; an empty typed value becomes None.

Example:
    >>> ds = vertexrt.data.open_dataset("gs://b/training-*.csv", format=CSV(types={"age": int, "y": float}))
"""

from __future__ import annotations

import csv as _csv
import io
import itertools
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from vertexrt.data._io import compression_for
from vertexrt.data._lines import line_chunks, locate
from vertexrt.data.formats import Errors, FileSource, Format
from vertexrt.errors import DataError

_BATCH = 256


class CSV(Format):
    """CSV rows as dicts keyed by the header.

    Args:
        types: column -> converter (``int``, ``float``, ``bool``, any callable taking the string).
        delimiter: field separator (``"\\t"`` for TSV).
        columns: column names when the files have no header row.
        compression: ``"GZIP"``, ``"ZLIB"`` or ``""``; default from the extension.
    """

    name = "csv"

    def __init__(
        self,
        types: dict[str, Callable[[str], Any]] | None = None,
        delimiter: str = ",",
        columns: Sequence[str] | None = None,
        compression: str | None = None,
    ):
        self.types = dict(types or {})
        self.delimiter = delimiter
        self.columns = list(columns) if columns is not None else None
        self.compression = compression

    def read(
        self, source: FileSource, start: int, end: int | None, errors: Errors
    ) -> Iterator[tuple[int, list[tuple[tuple[str, ...], list[str]]]]]:
        compression = compression_for(source.uri, self.compression)
        header = None if start == 0 and self.columns is None else self.header(source)
        for pos, body in line_chunks(source.uri, compression, start, quoted=True):
            try:
                text = body.decode("utf-8")
            except UnicodeDecodeError as err:
                raise DataError(f"{source.uri}: byte {pos + err.start} is not UTF-8 ({err.reason})") from None
            rows = filter(None, _csv.reader(io.StringIO(text, newline=""), delimiter=self.delimiter))
            if header is None:
                first = next(rows, None)
                if first is None:
                    continue
                header = tuple(first)
                blank = len(body) - len(body.lstrip(b"\r\n"))
                end = body.find(b"\n", blank)  # header rows do not hold quoted newlines
                pos += len(body) + 1 if end < 0 else end + 1
            # Parsed lazily, a batch at a time from the same position: parsed rows are GC-tracked
            # objects, and a whole read's worth alive at once makes the collector crawl.
            while batch := [(header, row) for row in itertools.islice(rows, _BATCH)]:
                yield pos, batch

    def header(self, source: FileSource) -> tuple[str, ...]:
        """The column names of ``source`` (its first record, or ``columns``)."""
        if self.columns is not None:
            return tuple(self.columns)
        compression = compression_for(source.uri, self.compression)
        for _, body in line_chunks(source.uri, compression, 0, quoted=True):
            text = body.decode("utf-8", errors="replace")
            for row in _csv.reader(io.StringIO(text, newline=""), delimiter=self.delimiter):
                if row:
                    return tuple(row)
        raise DataError(f"{source.uri}: the CSV file is empty (no header row); pass CSV(columns=[...])")

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

        def same_row(line: bytes) -> bool:
            parsed = next(_csv.reader([line.decode("utf-8", errors="replace")], delimiter=delimiter), [])
            return parsed == raw[1]

        header, row = raw
        if len(row) != len(header):
            error = DataError(
                f"CSV row has {len(row)} columns, the header has {len(header)} ({list(header)})"
            )
        for source, position in origins:
            found = locate(source.uri, compression_for(source.uri, self.compression), position, same_row)
            if found is not None:
                return f"{source.uri}:{found[0]} (byte {found[1]}): {error}"
        return f"{origins[0][0].uri}: row {raw[1]!r}: {error}"

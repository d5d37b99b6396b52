"""CSV with a header row (RFC 4180 quoting, quoted newlines included), plain or GZIP/ZLIB-compressed.

Values are strings unless ``types`` maps a column to a converter; an empty typed value becomes None.

Example:
    >>> ds = vertexrt.data.open_dataset("gs://b/training-*.csv", format=CSV(types={"age": int, "y": float}))
"""

from __future__ import annotations

import csv as _csv
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from vertexrt.data._io import compression_for
from vertexrt.data._lines import line_chunks, locate
from vertexrt.data.formats import Errors, FileSource, Format
from vertexrt.errors import DataError


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
    ) -> Iterator[tuple[int, list[tuple[tuple[str, ...], str]]]]:
        compression = compression_for(source.uri, self.compression)
        header = None if start == 0 and self.columns is None else self.header(source)
        for pos, body in line_chunks(source.uri, compression, start, quoted=True):
            try:
                text = body.decode("utf-8")
            except UnicodeDecodeError as err:
                raise DataError(f"{source.uri}: byte {pos + err.start} is not UTF-8 ({err.reason})") from None
            lines = _records(text)
            if header is None:
                if not lines:
                    continue
                first = lines.pop(0)
                first_bytes = first.encode("utf-8")
                pos += body.find(first_bytes) + len(first_bytes) + 1
                header = tuple(next(_csv.reader([first], delimiter=self.delimiter)))
            if lines:
                yield pos, [(header, row) for row in _csv.reader(lines, delimiter=self.delimiter)]

    def header(self, source: FileSource) -> tuple[str, ...]:
        """The column names of ``source`` (its first record, or ``columns``)."""
        if self.columns is not None:
            return tuple(self.columns)
        compression = compression_for(source.uri, self.compression)
        for _, body in line_chunks(source.uri, compression, 0, quoted=True):
            lines = _records(body.decode("utf-8", errors="replace"))
            if lines:
                return tuple(next(_csv.reader(lines[:1], delimiter=self.delimiter)))
        raise DataError(f"{source.uri}: the CSV file is empty (no header row); pass CSV(columns=[...])")

    def decoder(self) -> Callable[[tuple[tuple[str, ...], list[str]]], dict[str, Any]]:
        types = list(self.types.items())

        def decode(raw: tuple[tuple[str, ...], list[str]]) -> dict[str, Any]:
            header, row = raw
            if len(row) != len(header):
                raise DataError(
                    f"CSV row has {len(row)} columns, the header has {len(header)} ({list(header)})"
                )
            record: dict[str, Any] = dict(zip(header, row, strict=True))
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

        return decode

    def describe(
        self, raw: tuple[tuple[str, ...], list[str]], origins: list[tuple[FileSource, int]], error: Exception
    ) -> str:
        delimiter = self.delimiter

        def same_row(line: bytes) -> bool:
            parsed = next(_csv.reader([line.decode("utf-8", errors="replace")], delimiter=delimiter), [])
            return parsed == raw[1]

        for source, position in origins:
            found = locate(source.uri, compression_for(source.uri, self.compression), position, same_row)
            if found is not None:
                return f"{source.uri}:{found[0]} (byte {found[1]}): {error}"
        return f"{origins[0][0].uri}: row {raw[1]!r}: {error}"


def _records(text: str) -> list[str]:
    """Split text into CSV records: on newlines, re-joining lines that sit inside a quoted field."""
    lines = text.split("\n")
    if '"' in text:
        merged: list[str] = []
        open_quote = False
        for line in lines:
            if open_quote:
                merged[-1] += "\n" + line
            else:
                merged.append(line)
            if line.count('"') % 2:
                open_quote = not open_quote
        lines = merged
    return [line for line in lines if line.strip()]

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
from vertexrt.data.formats import SKIPPED, Errors, FileSource, Format
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
    ) -> Iterator[tuple[int, list[str]]]:
        compression = compression_for(source.uri, self.compression)
        need_header = self.columns is None and start == 0
        for pos, body in line_chunks(source.uri, compression, start, quoted=True):
            try:
                text = body.decode("utf-8")
            except UnicodeDecodeError as err:
                raise DataError(f"{source.uri}: byte {pos + err.start} is not UTF-8 ({err.reason})") from None
            raws = _records(text)
            if need_header:
                if raws:
                    header = raws.pop(0)
                    header_bytes = header.encode("utf-8")
                    pos += body.find(header_bytes) + len(header_bytes) + 1
                    self._headers()[source.uri] = next(_csv.reader([header], delimiter=self.delimiter))
                    need_header = False
                if not raws:
                    continue
            if raws:
                yield pos, raws

    def header(self, source: FileSource) -> list[str]:
        """The column names of ``source`` (its first record, or ``columns``)."""
        if self.columns is not None:
            return self.columns
        compression = compression_for(source.uri, self.compression)
        for _, body in line_chunks(source.uri, compression, 0, quoted=True):
            raws = _records(body.decode("utf-8", errors="replace"))
            if raws:
                return next(_csv.reader(raws[:1], delimiter=self.delimiter))
        raise DataError(f"{source.uri}: the CSV file is empty (no header row); pass CSV(columns=[...])")

    def decode(self, raws: list[str], source: FileSource, position: int, errors: Errors) -> list[Any]:
        header = self._header_cache(source)
        width = len(header)
        out = []
        types = [(name, self.types[name]) for name in header if name in self.types]
        for index, row in enumerate(_csv.reader(raws, delimiter=self.delimiter)):
            if len(row) != width:
                where = self._where(source, position, raws[index])
                errors.bad(f"{where}: CSV row has {len(row)} columns, the header has {width} ({header})")
                out.append(SKIPPED)
                continue
            record: dict[str, Any] = dict(zip(header, row, strict=True))
            try:
                for name, convert in types:
                    value = record[name]
                    record[name] = convert(value) if value != "" else None
            except (TypeError, ValueError) as err:
                where = self._where(source, position, raws[index])
                errors.bad(f"{where}: column {name!r} value {record[name]!r} cannot be converted: {err}")
                out.append(SKIPPED)
                continue
            out.append(record)
        return out

    def _headers(self) -> dict[str, list[str]]:
        return self.__dict__.setdefault("_header_by_uri", {})  # type: ignore[no-any-return]

    def _header_cache(self, source: FileSource) -> list[str]:
        cache = self._headers()
        if source.uri not in cache:
            cache[source.uri] = self.header(source)
        return cache[source.uri]

    def _where(self, source: FileSource, position: int, raw: str) -> str:
        compression = compression_for(source.uri, self.compression)
        line_no, offset = locate(source.uri, compression, position, raw.encode("utf-8"))
        return f"{source.uri}:{line_no} (byte {offset})"

    def __getstate__(self) -> dict[str, Any]:
        return {k: v for k, v in vars(self).items() if k != "_header_by_uri"}

    def __repr__(self) -> str:
        return f"CSV(types={self.types!r}, delimiter={self.delimiter!r}, columns={self.columns!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, CSV) and self.__getstate__() == other.__getstate__()

    def __hash__(self) -> int:
        return hash(repr(self))


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

"""JSON Lines: one JSON value per line (orjson), plain or GZIP/ZLIB-compressed; blank lines are skipped.

Example:
    >>> ds = vertexrt.data.open_dataset("gs://b/export/training-*.jsonl", format=JSONL())
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from vertexrt.data._io import compression_for
from vertexrt.data._lines import line_lists, locate
from vertexrt.data.formats import Errors, FileSource, Format


class JSONL(Format):
    """JSON Lines records as Python values (usually dicts).

    Args:
        compression: ``"GZIP"``, ``"ZLIB"`` or ``""``; default from the extension (``.gz``).
    """

    name = "jsonl"

    def __init__(self, compression: str | None = None):
        self.compression = compression

    def read(
        self, source: FileSource, start: int, end: int | None, errors: Errors
    ) -> Iterator[tuple[int, list[bytes]]]:
        for pos, lines in line_lists(source.uri, compression_for(source.uri, self.compression), start):
            raws = list(filter(None, lines))  # whitespace-only lines are dropped when they fail to decode
            if raws:
                yield pos, raws

    def ignorable(self, raw: bytes) -> bool:
        return not raw.strip()

    def decoder(self) -> Callable[[bytes], Any]:
        import orjson

        return orjson.loads  # type: ignore[no-any-return]

    def describe(self, raw: bytes, origins: list[tuple[FileSource, int]], error: Exception) -> str:
        compression = ""
        for source, position in origins:
            compression = compression_for(source.uri, self.compression)
            found = locate(source.uri, compression, position, raw)
            if found is not None:
                return f"{source.uri}:{found[0]} (byte {found[1]}): malformed JSON line: {error}"
        return f"{origins[0][0].uri}: malformed JSON line {raw[:80]!r}: {error}"

"""JSON Lines: one JSON value per line (orjson), plain or GZIP/ZLIB-compressed. Blank lines are skipped.

Example:
    >>> ds = vertexrt.data.open_dataset("gs://b/export/training-*.jsonl", format=JSONL())
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from vertexrt.data._io import compression_for
from vertexrt.data._lines import line_chunks, locate
from vertexrt.data.formats import SKIPPED, Errors, FileSource, Format


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
        compression = compression_for(source.uri, self.compression)
        for pos, body in line_chunks(source.uri, compression, start):
            raws = [line for line in body.split(b"\n") if line.strip()]
            if raws:
                yield pos, raws

    def decode(self, raws: list[bytes], source: FileSource, position: int, errors: Errors) -> list[Any]:
        import orjson

        loads = orjson.loads
        try:
            return [loads(line) for line in raws]
        except orjson.JSONDecodeError:
            pass
        out = []
        for line in raws:
            try:
                out.append(loads(line))
            except orjson.JSONDecodeError as err:
                compression = compression_for(source.uri, self.compression)
                line_no, offset = locate(source.uri, compression, position, line)
                errors.bad(f"{source.uri}:{line_no} (byte {offset}): malformed JSON line: {err}")
                out.append(SKIPPED)
        return out

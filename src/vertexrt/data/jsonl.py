"""JSON Lines: one JSON value per line (orjson), plain or GZIP/ZLIB-compressed; blank lines are skipped.

Example:
    >>> ds = vertexrt.data.open_dataset("gs://b/export/training-*.jsonl", format=JSONL())
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from vertexrt.data._io import MAX_RECORD_BYTES, compression_for
from vertexrt.data._lines import line_lists, locate
from vertexrt.data.formats import Errors, FileSource, Format, byte_pieces


class JSONL(Format):
    """JSON Lines records as Python values (usually dicts).

    Args:
        compression: ``"GZIP"``, ``"ZLIB"`` or ``""``; default from the extension (``.gz``).
        max_record_bytes: a longer line is a bad record (refused before it is buffered; default 256 MiB).
    """

    name = "jsonl"

    def __init__(self, compression: str | None = None, max_record_bytes: int = MAX_RECORD_BYTES):
        self.compression = compression
        self.max_record_bytes = int(max_record_bytes)

    def read(
        self, source: FileSource, start: int, end: int | None, errors: Errors
    ) -> Iterator[tuple[int, list[bytes]]]:
        compression = compression_for(source.uri, self.compression)
        lists = line_lists(
            source.uri,
            compression,
            start,
            errors,
            limit=self.max_record_bytes,
            end=end,
            file_size=source.size,
        )
        for pos, lines in lists:
            raws = list(filter(None, lines))  # whitespace-only lines are dropped when they fail to decode
            if raws:
                yield pos, raws

    def split(self, source: FileSource, parts: int, columnar: bool) -> list[tuple[int, int]] | None:
        """Byte ranges of an uncompressed file (row path only: columnar positions count rows)."""
        if columnar or compression_for(source.uri, self.compression):
            return None
        return byte_pieces(source.size, parts)

    def read_columns(
        self, source: FileSource, start: int, end: int | None, errors: Errors
    ) -> Iterator[tuple[int, Any]]:
        """Column batches by pyarrow's JSON reader (each line an object; Arrow infers the types from the
        first block). Positions count rows from the file start."""
        import pyarrow.json as pajson

        from vertexrt.data.columns import ARROW_BLOCK, arrow_text_batches

        def open_reader(f: Any) -> Any:
            return pajson.open_json(f, read_options=pajson.ReadOptions(block_size=ARROW_BLOCK))

        if source.size:
            yield from arrow_text_batches(
                source.uri, compression_for(source.uri, self.compression), open_reader, errors
            )

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

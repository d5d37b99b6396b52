"""Opening data files for large sequential reads, with GZIP/ZLIB decompression and decompressed offsets.

Positions inside a compressed file are offsets in its *decompressed* stream; a compressed stream cannot be
seeked, so starting at a position re-reads (and discards) the bytes before it.
"""

from __future__ import annotations

import zlib
from typing import IO, Any

from vertexrt.errors import DataError

READ_SIZE = 8 << 20
"""Bytes asked for per read: large sequential reads are what remote stores are fast at."""

GCS_BLOCK_SIZE = 16 << 20

COMPRESSIONS = ("", "GZIP", "ZLIB")


def compression_for(uri: str, explicit: str | None) -> str:
    """``"GZIP"`` / ``"ZLIB"`` / ``""``: the explicit choice, else from the extension (``.gz``, ``.zz``)."""
    if explicit is not None:
        choice = explicit.upper()
        if choice not in COMPRESSIONS:
            raise DataError(f"unknown compression {explicit!r} for {uri}: use '', 'GZIP' or 'ZLIB'")
        return choice
    lower = uri.lower()
    if lower.endswith((".gz", ".gzip")):
        return "GZIP"
    if lower.endswith((".zz", ".zlib")):
        return "ZLIB"
    return ""


class _Inflate:
    """A read-only stream that inflates a zlib/gzip stream (``wbits`` 15 for ZLIB, 31 for GZIP).

    Handles concatenated gzip members, as ``gzip`` files written by several writers contain.
    """

    def __init__(self, raw: IO[bytes], wbits: int, uri: str):
        self._raw = raw
        self._wbits = wbits
        self._uri = uri
        self._inflater = zlib.decompressobj(wbits)
        self._pending = b""
        self._consumed = 0  # compressed bytes read so far (for error messages)
        self._fed = False
        self._eof = False

    def read(self, size: int) -> bytes:
        out = [self._pending] if self._pending else []
        have = len(self._pending)
        self._pending = b""
        while have < size and not self._eof:
            if self._inflater.eof:
                data = self._inflater.unused_data or self._read_raw()
                self._inflater = zlib.decompressobj(self._wbits)
                self._fed = False
            else:
                data = self._inflater.unconsumed_tail or self._read_raw()
            if not data:
                if self._fed and not self._inflater.eof:
                    raise DataError(
                        f"{self._uri}: compressed stream ends early (truncated after {self._consumed} "
                        "compressed bytes); re-copy the file"
                    )
                self._eof = True
                break
            try:
                piece = self._inflater.decompress(data, max(size - have, 1 << 16))
            except zlib.error as err:
                raise DataError(
                    f"{self._uri}: corrupt compressed data near compressed byte {self._consumed}: {err}"
                ) from None
            self._fed = True
            if piece:
                out.append(piece)
                have += len(piece)
        joined = b"".join(out)
        if len(joined) > size:
            self._pending = joined[size:]
            joined = joined[:size]
        return joined

    def _read_raw(self) -> bytes:
        data = self._raw.read(READ_SIZE)
        self._consumed += len(data)
        return data

    def close(self) -> None:
        self._raw.close()


def open_at(uri: str, compression: str, start: int) -> Any:
    """Open ``uri`` for reading, positioned at decompressed offset ``start``.

    Example:
        >>> f = open_at("gs://b/part-0.jsonl.gz", "GZIP", 0)
    """
    from vertexrt import paths

    try:
        raw = paths.open(uri, "rb", block_size=GCS_BLOCK_SIZE)
    except FileNotFoundError:
        raise DataError(f"{uri}: file not found (was it deleted or renamed after the dataset was opened?)")
    except PermissionError as err:
        raise DataError(f"{uri}: permission denied ({err}); grant the job's service account read access")
    if not compression:
        if start:
            raw.seek(start)
        return raw
    stream = _Inflate(raw, 31 if compression == "GZIP" else 15, uri)
    left = start
    while left:
        got = len(stream.read(min(left, READ_SIZE)))
        if not got:
            raise DataError(f"{uri}: position {start} is past the end of the decompressed file")
        left -= got
    return stream

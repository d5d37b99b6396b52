"""Opening data files for large sequential reads, with GZIP/ZLIB decompression and decompressed offsets.

Positions inside a compressed file are offsets in its *decompressed* stream; a compressed stream cannot be
seeked, so starting at a position re-reads (and discards) the bytes before it. Cloud Storage objects are
read by range requests fetched ahead of the reader (:mod:`vertexrt.data._ranged`), each under the storage
deadline and retry policy of :mod:`vertexrt.retries` (``VERTEXRT_STORAGE_TIMEOUT``): a stalled object ends
as a :class:`~vertexrt.errors.DataError` naming it.
"""

from __future__ import annotations

import zlib
from typing import IO, Any

from vertexrt.data._ranged import RANGE_SIZE, TAIL_READ, RangedReader, storage_call, unreadable
from vertexrt.errors import DataError

READ_SIZE = RANGE_SIZE
"""Bytes asked for per read: large sequential reads are what remote stores are fast at (a Cloud Storage
object is fetched in ranges of this size, so a read of it takes one whole range, without a copy)."""

MAX_RECORD_BYTES = 256 << 20
"""Default bound on one record (a line, a CSV record, a TFRecord payload): larger is refused before it is
buffered, so a corrupt length field or a file without newlines cannot take all memory."""

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


class _Wrapped:
    """A read-only stream over another (``_raw``), closed with it."""

    _raw: IO[bytes]

    @property
    def closed(self) -> bool:
        return bool(self._raw.closed)

    def readable(self) -> bool:
        return True

    def close(self) -> None:
        self._raw.close()


class _Inflate(_Wrapped):
    """A read-only stream that inflates a zlib/gzip stream (``wbits`` 15 for ZLIB, 31 for GZIP).

    Handles concatenated gzip members, as ``gzip`` files written by several writers contain. A damaged
    stream first hands out everything that decompressed before the damage; the next read raises.
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
        self._error: DataError | None = None

    def read(self, size: int) -> bytes:
        if self._error is not None and not self._pending:
            raise self._error
        out = [self._pending] if self._pending else []
        have = len(self._pending)
        self._pending = b""
        while have < size and not self._eof and self._error is None:
            if self._inflater.eof:
                data = self._inflater.unused_data or self._read_raw()
                self._inflater = zlib.decompressobj(self._wbits)
                self._fed = False
            else:
                data = self._inflater.unconsumed_tail or self._read_raw()
            if not data:
                if self._fed and not self._inflater.eof:
                    self._fail(
                        f"{self._uri}: compressed stream ends early (truncated after {self._consumed} "
                        "compressed bytes); re-copy the file"
                    )
                    break
                self._eof = True
                break
            try:
                piece = self._inflater.decompress(data, max(size - have, 1 << 16))
            except zlib.error as err:
                self._fail(
                    f"{self._uri}: corrupt compressed data near compressed byte {self._consumed}: {err}"
                )
                break
            self._fed = True
            if piece:
                out.append(piece)
                have += len(piece)
        joined = b"".join(out)
        if not joined and self._error is not None:
            raise self._error
        if len(joined) > size:
            self._pending = joined[size:]
            joined = joined[:size]
        return joined

    def _fail(self, message: str) -> None:
        self._error = DataError(message)

    def _read_raw(self) -> bytes:
        data = self._raw.read(READ_SIZE)
        self._consumed += len(data)
        return data


class _Bounded(_Wrapped):
    """A file whose reads stop at byte ``end``; past it, reads are :data:`TAIL_READ` bytes, so finishing
    the record that crosses ``end`` costs about that record, not a whole large read."""

    def __init__(self, raw: IO[bytes], start: int, end: int):
        self._raw = raw
        self._pos = start
        self._end = end

    def read(self, size: int) -> bytes:
        left = self._end - self._pos
        data = self._raw.read(min(size, left) if left > 0 else min(size, TAIL_READ))
        self._pos += len(data)
        return data


def _open_raw(uri: str, start: int, end: int | None, size: int | None) -> Any:
    """The file at ``uri``, positioned at byte ``start``: a local (or mounted) file, whose reads stop at
    ``end`` (:class:`_Bounded`), or a Cloud Storage object read ahead by range requests
    (:class:`~vertexrt.data._ranged.RangedReader`), its size asked for only when ``size`` is None."""
    from vertexrt import paths

    fs, path = paths.filesystem(uri)
    if paths.is_local_filesystem(fs):
        raw = paths.open(uri, "rb")
        if start:
            raw.seek(start)
        return raw if end is None else _Bounded(raw, start, end)
    if size is None:
        info = storage_call("opening", uri, fs.info, path, kind="list")
        size = int(info.get("size") or 0)
    return RangedReader(fs, path, uri, start, size, end)


def open_at(
    uri: str, compression: str, start: int, end: int | None = None, *, size: int | None = None
) -> Any:
    """Open ``uri`` for reading, positioned at decompressed offset ``start``; with ``end`` (an
    uncompressed file only), reads are sized to stop at byte ``end`` and go on in small reads past it.

    ``size``: the file's size in bytes when the listing gave it (:class:`~vertexrt.data.formats.FileSource`),
    so that opening a Cloud Storage object costs no metadata request. A Cloud Storage object's bytes are
    fetched ahead of the reader (:mod:`vertexrt.data._ranged`): the next ranges arrive while these are
    parsed.

    Example:
        >>> f = open_at("gs://b/part-0.jsonl.gz", "GZIP", 0)
        >>> piece = open_at("gs://b/big.csv", "", 1 << 30, end=2 << 30, size=source.size)
    """
    if compression and end is not None:
        raise DataError(f"{uri}: a {compression} file cannot be read by byte range; read it whole")
    try:
        raw = _open_raw(uri, 0 if compression else start, end, size)
    except (FileNotFoundError, PermissionError) as err:
        raise unreadable(uri, err) from err
    if not compression:
        return raw
    stream = _Inflate(raw, 31 if compression == "GZIP" else 15, uri)
    left = start
    while left:
        got = len(stream.read(min(left, READ_SIZE)))
        if not got:
            raise DataError(f"{uri}: position {start} is past the end of the decompressed file")
        left -= got
    return stream

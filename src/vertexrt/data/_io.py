"""Opening data files for large sequential reads, with GZIP/ZLIB decompression and decompressed offsets.

Positions inside a compressed file are offsets in its *decompressed* stream; a compressed stream cannot be
seeked, so starting at a position re-reads (and discards) the bytes before it. Cloud Storage objects are
read by range requests, each under the storage deadline and retry policy of :mod:`vertexrt.retries`
(``VERTEXRT_STORAGE_TIMEOUT``): a stalled object ends as a :class:`~vertexrt.errors.DataError` naming it.
"""

from __future__ import annotations

import zlib
from typing import IO, Any

from vertexrt.errors import DataError

READ_SIZE = 8 << 20
"""Bytes asked for per read: large sequential reads are what remote stores are fast at."""

GCS_BLOCK_SIZE = 16 << 20

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


class _Ranged:
    """A Cloud Storage object read from ``start`` by range requests, each under the storage deadline."""

    def __init__(self, fs: Any, path: str, uri: str, start: int, size: int):
        self._fs = fs
        self._path = path
        self._uri = uri
        self._pos = start
        self._size = size
        self.closed = False

    def readable(self) -> bool:
        return True

    def read(self, size: int = -1) -> bytes:
        end = self._size if size < 0 else min(self._size, self._pos + size)
        if end <= self._pos:
            return b""
        try:
            data: bytes = _storage_call(
                "reading", self._uri, self._fs.cat_file, self._path, start=self._pos, end=end
            )
        except FileNotFoundError:  # opened with its listed size: a file deleted since fails here
            raise DataError(f"{self._uri}: {NOT_FOUND}") from None
        self._pos += len(data)
        return data

    def close(self) -> None:
        self.closed = True


def _storage_call(operation: str, uri: str, fn: Any, *args: Any, **kwargs: Any) -> Any:
    """:func:`vertexrt.retries.call`, its :class:`~vertexrt.errors.StorageError` raised as a DataError."""
    from vertexrt import retries
    from vertexrt.errors import StorageError

    try:
        return retries.call(operation, uri, fn, *args, **kwargs)
    except StorageError as err:
        raise DataError(str(err)) from err


def _open_raw(uri: str, start: int, size: int | None = None) -> Any:
    """The file at ``uri``, positioned at byte ``start``: a local (or mounted) file, or a :class:`_Ranged`
    Cloud Storage object (of ``size`` bytes when known: no metadata request)."""
    from vertexrt import paths

    fs, path = paths.filesystem(uri)
    if paths.is_local_filesystem(fs):
        raw = paths.open(uri, "rb")
        if start:
            raw.seek(start)
        return raw
    if size is None:
        size = int(_storage_call("opening", uri, fs.info, path, kind="list").get("size") or 0)
    return _Ranged(fs, path, uri, start, size)


NOT_FOUND = "file not found (was it deleted or renamed after the dataset was opened?)"
TAIL_READ = 64 << 10
"""Bytes asked for per read past the end of a byte range: only the record that crosses the end is wanted."""


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


def open_at(uri: str, compression: str, start: int, end: int | None = None, size: int | None = None) -> Any:
    """Open ``uri`` for reading, positioned at decompressed offset ``start``; with ``end`` (an
    uncompressed file only), reads are sized to stop at byte ``end`` and go on in small reads past it.
    ``size``: the file's size when known (its listing's): a Cloud Storage object is opened without a
    metadata request.

    Example:
        >>> f = open_at("gs://b/part-0.jsonl.gz", "GZIP", 0)
        >>> piece = open_at("gs://b/big.csv", "", 1 << 30, end=2 << 30)
    """
    try:
        raw = _open_raw(uri, 0 if compression else start, size)
    except FileNotFoundError:
        raise DataError(f"{uri}: {NOT_FOUND}")
    except PermissionError as err:
        raise DataError(f"{uri}: permission denied ({err}); grant the job's service account read access")
    if not compression:
        return raw if end is None else _Bounded(raw, start, end)
    if end is not None:
        raw.close()
        raise DataError(f"{uri}: a {compression} file cannot be read by byte range; read it whole")
    stream = _Inflate(raw, 31 if compression == "GZIP" else 15, uri)
    left = start
    while left:
        got = len(stream.read(min(left, READ_SIZE)))
        if not got:
            raise DataError(f"{uri}: position {start} is past the end of the decompressed file")
        left -= got
    return stream

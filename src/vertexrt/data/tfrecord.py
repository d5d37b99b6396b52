"""TFRecord files without TensorFlow: reader (CRC32C verified), writer, plain or GZIP/ZLIB.

Framing per record: ``uint64 length (LE) | uint32 masked_crc32c(length bytes) | payload |
uint32 masked_crc32c(payload)``; CRC-32C via the C ``google-crc32c`` library.

Example:
    >>> with TFRecordWriter("gs://b/data/part-0.tfrecord.gz") as w:
    ...     w.write(b"payload")
    >>> ds = vertexrt.data.open_dataset("gs://b/data/part-*.tfrecord.gz", shuffle=False)
"""

from __future__ import annotations

import struct
import zlib
from collections.abc import Callable, Iterator
from types import TracebackType
from typing import IO, Any

from vertexrt.data._io import READ_SIZE, compression_for, open_at
from vertexrt.data.formats import Errors, FileSource, Format
from vertexrt.errors import DataError

_MASK_DELTA = 0xA282EAD8
_HEADER = struct.Struct("<QI")
_FOOTER = struct.Struct("<I")


def masked_crc32c(data: bytes) -> int:
    """TFRecord's masked CRC-32C: rotate right 15 bits, add ``0xa282ead8`` (mod 2**32)."""
    from google_crc32c import value

    crc = value(data)
    return (((crc >> 15) | (crc << 17)) + _MASK_DELTA) & 0xFFFFFFFF


def encode_record(payload: bytes) -> bytes:
    """One framed record (header, payload, footer)."""
    length = struct.pack("<Q", len(payload))
    return b"".join(
        (length, _FOOTER.pack(masked_crc32c(length)), payload, _FOOTER.pack(masked_crc32c(payload)))
    )


class TFRecord(Format):
    """TFRecord records as ``bytes`` (or dicts with ``example=True``).

    Args:
        compression: ``"GZIP"``, ``"ZLIB"`` or ``""``; default from the extension (``.gz``, ``.zz``).
        example: decode each payload as a ``tf.train.Example`` into ``{name: list}`` (no TensorFlow needed).
    """

    name = "tfrecord"

    def __init__(self, compression: str | None = None, example: bool = False):
        self.compression = compression
        self.example = example

    def read(
        self, source: FileSource, start: int, end: int | None, errors: Errors
    ) -> Iterator[tuple[int, list[bytes]]]:
        from google_crc32c import value as crc32c

        uri = source.uri
        f = open_at(uri, compression_for(uri, self.compression), start)
        unpack_header = _HEADER.unpack_from
        unpack_footer = _FOOTER.unpack_from
        length_crcs: dict[int, int] = {}
        try:
            base = start  # file offset of buf[0]
            buf = b""
            want = READ_SIZE
            while True:
                data = f.read(want)
                if not data:
                    if buf:
                        errors.bad(
                            f"{uri}: truncated record at byte {base} ({len(buf)} trailing bytes are not a "
                            "whole record; the file was cut short — re-copy it)"
                        )
                    return
                buf = buf + data if buf else data
                n = len(buf)
                pos = first = 0  # first: where out[0] starts in buf
                out: list[bytes] = []
                append = out.append
                while pos + 12 <= n:
                    length, length_crc = unpack_header(buf, pos)
                    if length_crcs.get(length) != length_crc:
                        if masked_crc32c(buf[pos : pos + 8]) != length_crc:
                            if out:
                                yield base + first, out
                            errors.bad(
                                f"{uri}: corrupted record at byte {base + pos} (length CRC mismatch); "
                                "the rest of the file is skipped"
                            )
                            return
                        length_crcs[length] = length_crc
                    stop = pos + 12 + length
                    if stop + 4 > n:
                        break
                    payload = buf[pos + 12 : stop]
                    rot = (unpack_footer(buf, stop)[0] - _MASK_DELTA) & 0xFFFFFFFF
                    if crc32c(payload) == ((rot >> 17) | (rot << 15)) & 0xFFFFFFFF:
                        append(payload)
                    else:
                        if out:
                            yield base + first, out
                            out = []
                            append = out.append
                        errors.bad(f"{uri}: corrupted record at byte {base + pos} (payload CRC mismatch)")
                        first = stop + 4
                    pos = stop + 4
                if out:
                    yield base + first, out
                buf = buf[pos:]
                base += pos
                need = _HEADER.unpack_from(buf)[0] + 16 - len(buf) if len(buf) >= 12 else 12
                want = max(READ_SIZE, need)
        finally:
            f.close()

    def decoder(self) -> Callable[[bytes], Any] | None:
        if not self.example:
            return None
        from vertexrt.data.example import decode_example

        return decode_example

    def describe(self, raw: bytes, origins: list[tuple[FileSource, int]], error: Exception) -> str:
        source, position = origins[0]
        return f"{source.uri}: a record read at byte {position} or later is not a tf.train.Example: {error}"


class TFRecordWriter:
    """Write TFRecord files TensorFlow reads (``tf.data.TFRecordDataset``), to any path ``paths`` opens.

    Args:
        uri: local path, ``/gcs/`` path or ``gs://`` URI.
        compression: ``"GZIP"``, ``"ZLIB"`` or ``""``; default from the extension.

    Example:
        >>> with TFRecordWriter("/tmp/x.tfrecord") as w:
        ...     w.write(b"hello")
    """

    def __init__(self, uri: str, compression: str | None = None):
        from vertexrt import paths

        self.uri = str(uri)
        self.compression = compression_for(self.uri, compression)
        self._file: IO[bytes] = paths.open(self.uri, "wb", block_size=32 << 20)
        self._deflate: Any = None
        if self.compression:
            wbits = 31 if self.compression == "GZIP" else 15
            self._deflate = zlib.compressobj(6, zlib.DEFLATED, wbits)
        self._pending: list[bytes] = []
        self._pending_bytes = 0
        self.records = 0

    def write(self, payload: bytes) -> None:
        """Append one record."""
        if self._file is None:
            raise DataError(f"{self.uri}: write() after close()")
        record = encode_record(bytes(payload))
        self._pending.append(record)
        self._pending_bytes += len(record)
        self.records += 1
        if self._pending_bytes >= READ_SIZE:
            self._drain()

    def flush(self) -> None:
        """Hand buffered records to the file (a remote object is only complete after ``close``)."""
        self._drain()
        self._file.flush()

    def close(self) -> None:
        """Finish the compressed stream and close (commit) the file."""
        if self._file is None:
            return
        self._drain()
        if self._deflate is not None:
            self._file.write(self._deflate.flush())
        self._file.close()
        self._file = None  # type: ignore[assignment]

    def _drain(self) -> None:
        if not self._pending:
            return
        data = b"".join(self._pending)
        self._pending = []
        self._pending_bytes = 0
        self._file.write(self._deflate.compress(data) if self._deflate is not None else data)

    def __enter__(self) -> TFRecordWriter:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

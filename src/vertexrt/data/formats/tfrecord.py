"""TFRecord files without TensorFlow: reader (CRC32C verified), writer, plain or GZIP/ZLIB.

Framing per record: ``uint64 length (LE) | uint32 masked_crc32c(length bytes) | payload |
uint32 masked_crc32c(payload)``; CRC-32C via the C ``google-crc32c`` library.
A run of records of one length is framed by ``struct.iter_unpack`` and CRC-checked by one ``map`` over its
payloads (no Python step per record); a header or CRC that does not match goes to the record-by-record loop,
which reports it at its byte.

An uncompressed file is cut into byte ranges for several readers (:meth:`TFRecord.split`): a reader whose
range starts mid-file finds the first record by :func:`first_record` (a header whose CRC matches, a
payload whose CRC matches, and a valid header or the end of the file right after it) and reads every
record that begins in its range. The reader of the range before checks that the same rule finds the record
its own framing reached, so a payload holding bytes that frame as records is an error, never a duplicate.

Example:
    >>> with TFRecordWriter("gs://b/data/part-0.tfrecord.gz") as w:
    ...     w.write(b"payload")
    >>> ds = vertexrt.data.open_dataset("gs://b/data/part-*.tfrecord.gz", shuffle=False)
"""

from __future__ import annotations

import re
import struct
import zlib
from collections.abc import Callable, Iterator
from types import TracebackType
from typing import IO, Any

from vertexrt.data._io import MAX_RECORD_BYTES, READ_SIZE, TAIL_READ, compression_for, open_at
from vertexrt.data.formats.base import Errors, FileSource, Format, byte_pieces
from vertexrt.errors import DataError

_MASK_DELTA = 0xA282EAD8
_HEADER = struct.Struct("<QI")
_FOOTER = struct.Struct("<I")
_NONZERO = re.compile(rb"[^\x00]")


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
        max_record_bytes: a record claiming a longer payload is refused before anything is allocated for
            it (default 256 MiB); the rest of its file is skipped (its framing can no longer be trusted).
    """

    name = "tfrecord"

    def __init__(
        self, compression: str | None = None, example: bool = False, max_record_bytes: int = MAX_RECORD_BYTES
    ):
        self.compression = compression
        self.example = example
        self.max_record_bytes = int(max_record_bytes)

    def read(
        self, source: FileSource, start: int, end: int | None, errors: Errors
    ) -> Iterator[tuple[int, list[bytes]]]:
        from google_crc32c import value as crc32c

        uri = source.uri
        if end is not None and start:  # a piece of the file: its first record begins here or later
            start = first_record(source, start, self.max_record_bytes)
        if end is not None and start >= end:
            return
        f = open_at(uri, compression_for(uri, self.compression), start, end, size=source.size)
        unpack_header = _HEADER.unpack_from
        unpack_footer = _FOOTER.unpack_from
        length_crcs: dict[int, int] = {}
        runs: dict[int, struct.Struct] = {}  # payload length -> the framing of one record of that length
        limit = self.max_record_bytes
        try:
            base = start  # file offset of buf[0]
            buf = b""
            want = need = READ_SIZE
            while True:
                try:
                    data = f.read(want)
                except DataError as err:  # a damaged compressed stream, after every whole record before it
                    errors.bad(str(err))
                    return
                if not data:
                    if buf:
                        errors.bad(
                            f"{uri}: truncated record at byte {base} ({len(buf)} trailing bytes are not a "
                            "whole record; the file was cut short — re-copy it)"
                        )
                    return
                if buf and len(buf) >= 12 and need <= len(data):
                    # the record crossing the reads is completed on its own (a copy of that record, not
                    # of the whole read), then the read is framed where that record ends
                    segments = [
                        (b"".join((buf, memoryview(data)[:need])), base, 0),
                        (data, base + len(buf), need),
                    ]
                else:
                    segments = [(buf + data if buf else data, base, 0)]
                for buf, base, pos in segments:
                    n = len(buf)
                    first = pos  # where out[0] starts in buf
                    last = -1  # the payload length of the record before
                    view = memoryview(buf)
                    out: list[bytes] = []
                    append = out.append
                    stop_at = n if end is None else min(n, end - base)  # records beginning before ``end``
                    while pos < stop_at and pos + 12 <= n:
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
                            if length > limit:
                                if out:
                                    yield base + first, out
                                errors.bad(
                                    f"{uri}: record at byte {base + pos} claims {length} bytes, over "
                                    f"max_record_bytes={limit}: a corrupt length (the rest of the file is "
                                    "skipped), or raise TFRecord(max_record_bytes=...)"
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
                            if length == last:  # a run of records of one length: framed in C from here
                                frame = runs.get(length) or runs.setdefault(
                                    length, struct.Struct(f"<QI{length}sI")
                                )
                                count = min(
                                    (n - stop - 4) // frame.size, -(-(stop_at - stop - 4) // frame.size)
                                )
                                stop = _run(view, stop + 4, count, frame, length_crc, out, crc32c) - 4
                            last = length
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
                    if end is not None and base + pos >= end:  # the next record is the next piece's
                        self._check_cut(source, end, base + pos, errors)
                        return
                buf = buf[pos:]
                base += pos
                need = _HEADER.unpack_from(buf)[0] + 16 - len(buf) if len(buf) >= 12 else 12
                want = max(READ_SIZE, need)
        finally:
            f.close()

    def split(self, source: FileSource, parts: int, columnar: bool) -> list[tuple[int, int]] | None:
        """Byte ranges of an uncompressed file (a compressed one is read whole)."""
        if columnar or compression_for(source.uri, self.compression):
            return None
        return byte_pieces(source.size, parts)

    def _check_cut(self, source: FileSource, end: int, reached: int, errors: Errors) -> None:
        """Check that the reader of the piece from ``end`` starts where this one stopped (``reached``).

        Earlier: bytes inside a record frame as one (they would be read twice): raises. Later: the record
        at ``reached`` is damaged (the next reader skips it): a bad record."""
        if reached == end == source.size:
            return
        found = first_record(source, end, self.max_record_bytes)
        if found > reached:
            errors.bad(
                f"{source.uri}: corrupted record at byte {reached} (it, or the header after it, fails its "
                f"CRC); bytes {reached}-{found} are skipped"
            )
        if found < reached:
            raise DataError(
                f"{source.uri}: the record that crosses byte {end} holds bytes at byte {found} that "
                "frame as a TFRecord (a payload holding TFRecord data), so the file cannot be read in "
                "byte ranges: write it as at least as many files as readers, or GZIP it (a "
                "compressed file is read whole)"
            )

    def decoder(self) -> Callable[[bytes], Any] | None:
        if not self.example:
            return None
        from vertexrt.data.example import decode_example

        return decode_example

    def describe(self, raw: bytes, origins: list[tuple[FileSource, int]], error: Exception) -> str:
        source, position = origins[0]
        return f"{source.uri}: a record read at byte {position} or later is not a tf.train.Example: {error}"


def _run(
    view: memoryview,
    pos: int,
    count: int,
    frame: struct.Struct,
    length_crc: int,
    out: list[bytes],
    crc32c: Callable[[bytes], int],
) -> int:
    """Append to ``out`` the payloads of up to ``count`` records of one length from ``view[pos]`` on, framed
    by ``frame`` (``struct.iter_unpack``: no Python step per record), and return where they end: the first
    record whose header or CRC does not match is left to the record-by-record loop (which reports it)."""
    length = frame.size - 16
    block = 16  # records per try, doubling: a run that breaks early costs little
    while count > 0:
        m = min(block, count)
        records = frame.iter_unpack(view[pos : pos + m * frame.size])
        lengths, length_crcs, payloads, footers = zip(*records, strict=True)
        good = m
        if lengths.count(length) != m or length_crcs.count(length_crc) != m:
            good = next(i for i in range(m) if lengths[i] != length or length_crcs[i] != length_crc)
        masked = [(((c >> 15) | (c << 17)) + _MASK_DELTA) & 0xFFFFFFFF for c in map(crc32c, payloads[:good])]
        if masked != list(footers[:good]):
            good = next(i for i in range(good) if masked[i] != footers[i])
        out.extend(payloads[:good])
        pos += good * frame.size
        if good < m:
            return pos
        count -= m
        block = min(2 * block, 4096)
    return pos


def first_record(source: FileSource, at: int, limit: int = MAX_RECORD_BYTES) -> int:
    """The first byte offset ``>= at`` of ``source`` (uncompressed) where a record begins, by the framing
    alone: a header whose length is at most ``limit`` and whose CRC matches, a payload whose CRC matches,
    then a valid header or the end of the file. ``source.size`` when there is none.

    Example:
        >>> first_record(FileSource("gs://b/big.tfrecord", 1 << 30), 1 << 29) >= 1 << 29
        True
    """
    w = _Window(source, at)
    try:
        p = 0  # the candidate, in w.buf
        while w.holds(w.base + p + 12):
            # a length under 4 GiB has four zero high bytes: only such offsets are candidates
            q = w.buf.find(b"\x00\x00\x00\x00", p + 4)
            if q < 0:
                p = max(len(w.buf) - 11, p)  # the last 11 bytes may start a candidate
                w.drop(p)
                p = 0
                if not w.holds(w.base + len(w.buf) + 1):
                    return source.size
                continue
            p = q - 4
            if not w.holds(w.base + p + 12):
                return source.size
            if _is_record(w, p, limit):
                return w.base + p
            if not w.buf[p : p + 12].strip(b"\x00"):  # inside a zero run: no record begins in it
                nonzero = _NONZERO.search(w.buf, p)
                p = max(p + 1, (nonzero.start() if nonzero else len(w.buf)) - 11)
            else:
                p += 1
            if p > READ_SIZE:
                w.drop(p)
                p = 0
        return source.size
    finally:
        w.close()


class _Window:
    """Bytes of a file from ``base`` on, read forward as a scan needs them: small reads, and one read of
    the right size for a long record."""

    def __init__(self, source: FileSource, at: int):
        self.uri = source.uri
        self.size = source.size
        self.base = at
        self.buf = b""
        self._end = min(self.size, at + TAIL_READ)  # the range the file is open for
        self._f = open_at(self.uri, "", at, self._end, size=self.size)

    def holds(self, upto: int) -> bool:
        """Read on until ``buf`` holds the bytes up to file offset ``upto``; False past the file's end."""
        if upto > self.size:
            return False
        have = self.base + len(self.buf)
        if have >= upto:
            return True
        if upto > self._end:  # open again for the whole span: one request, not many small ones
            self._f.close()
            self._end = min(self.size, max(upto, have + TAIL_READ))
            self._f = open_at(self.uri, "", have, self._end, size=self.size)
        parts = [self.buf]
        while have < upto:
            data = self._f.read(max(TAIL_READ, upto - have))
            if not data:
                break
            parts.append(data)
            have += len(data)
        self.buf = b"".join(parts)
        return have >= upto

    def drop(self, count: int) -> None:
        """Forget the first ``count`` bytes."""
        self.base += count
        self.buf = self.buf[count:]

    def close(self) -> None:
        self._f.close()


def _is_record(w: _Window, p: int, limit: int) -> bool:
    """True when a whole valid record begins at ``w.buf[p]``, followed by a valid header or the file's end."""
    length, length_crc = _HEADER.unpack_from(w.buf, p)
    if length > limit or masked_crc32c(w.buf[p : p + 8]) != length_crc:
        return False
    footer = w.base + p + 12 + length
    if not w.holds(footer + 4):
        return False
    at = footer - w.base
    if masked_crc32c(w.buf[p + 12 : at]) != _FOOTER.unpack_from(w.buf, at)[0]:
        return False
    if footer + 4 == w.size:
        return True
    if not w.holds(footer + 16):
        return False
    following, following_crc = _HEADER.unpack_from(w.buf, at + 4)
    return following <= limit and masked_crc32c(w.buf[at + 4 : at + 12]) == following_crc


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

"""Line-oriented chunking shared by the JSONL and CSV readers, and finding a bad record's line number.

A record (a line; for CSV a record, whose quoted fields may hold newlines) longer than ``limit`` bytes is
reported to ``errors`` before it is buffered further; with ``on_error="skip"`` reading goes on at the next
newline. A read is at most ``limit`` bytes, so only a record that began in an earlier read can be longer
than the limit, and that one is checked: the outcome does not depend on where reads begin (exact resume).
A damaged compressed stream hands out every whole record before the damage, then reports it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from vertexrt.data._io import MAX_RECORD_BYTES, READ_SIZE, open_at
from vertexrt.data.formats.base import Errors
from vertexrt.errors import DataError

LOCAL_READ_SIZE = 1 << 20
"""Bytes per read on local disk: the lines of a read are still in the CPU cache when they are decoded."""


def read_size(uri: str) -> int:
    """Bytes per read of ``uri``: large reads from Cloud Storage (``gs://``, ``/gcs/``), smaller locally."""
    from vertexrt.paths import storage_kind

    return LOCAL_READ_SIZE if storage_kind(uri) == "local" else READ_SIZE


def _read(f: Any, size: int, errors: Errors) -> bytes | None:
    """The next read, or None when the stream is damaged (reported to ``errors``: raises or counts)."""
    try:
        data: bytes = f.read(size)
    except DataError as err:
        errors.bad(str(err))
        return None
    return data


def _too_long(
    uri: str, compression: str, offset: int, limit: int, what: str, hint: str, errors: Errors
) -> None:
    line = line_at(uri, compression, offset)
    errors.bad(
        f"{uri}:{line} (byte {offset}): {what} is longer than {limit} bytes{hint}; if such records are real, "
        "raise the format's max_record_bytes"
    )


def _after_newline(data: bytes, pos: int) -> tuple[bytes | None, int]:
    """What follows the first newline in ``data`` (read at offset ``pos``) and its offset; ``None`` and the
    offset after ``data`` when it holds no newline (a piece's reader skips the record it starts inside)."""
    nl = data.find(b"\n")
    if nl < 0:
        return None, pos + len(data)
    return data[nl + 1 :], pos + nl + 1


def line_chunks(
    uri: str,
    compression: str,
    start: int,
    errors: Errors,
    *,
    limit: int = MAX_RECORD_BYTES,
    end: int | None = None,
    file_size: int | None = None,
) -> Iterator[tuple[int, bytes]]:
    """``(offset, body)``: whole CSV records from ``start``; ``body`` ends right before a newline (or at EOF).

    A newline inside a double-quoted field does not end a record: a chunk is cut only where the count of
    ``"`` characters since ``start`` is even. Linear in the input, whatever its quoting.

    With ``end`` (a piece of a file): the records that begin in ``[start, end)``, the first one found at
    the first newline from ``start - 1``. A quoted newline there would mislead the next piece's reader,
    so the record crossing ``end`` is checked to end at the first newline from ``end - 1``.

    ``file_size``: the file's size when known (no metadata request to open it).

    Raises:
        DataError: a quoted field holding a newline crosses ``end``.
    """
    f = open_at(uri, compression, start - 1 if start and end is not None else start, end, size=file_size)
    size = min(read_size(uri), limit)
    try:
        pos = start
        rest = b""
        scanned = odd = 0  # rest[:scanned] holds no record end and has quote parity ``odd``
        # dropping bytes up to the next newline (after an overlong record, or to a piece's first record)
        skipping = bool(start and end is not None)
        if skipping:
            pos = start - 1
        while True:
            data = _read(f, size, errors)
            if data is None:  # damaged: the partial record at the damage is the bad one
                return
            if not data:
                if rest and not skipping and (end is None or pos < end):
                    yield pos, rest
                return
            if skipping:
                data, pos = _after_newline(data, pos)
                if data is None:
                    continue
                skipping = False
            if end is not None and pos >= end:
                return
            carried = bool(rest)  # a record began in an earlier read: it must end within the limit
            buf = rest + data if rest else data
            while True:
                if carried:
                    first = next_record_end(buf, scanned, odd)
                    if first > limit or (first < 0 and len(buf) > limit):
                        _too_long(
                            uri, compression, pos, limit, "a CSV record", " (an unterminated quote?)", errors
                        )
                        nl = buf.find(b"\n")
                        if nl < 0:
                            pos, buf, rest, scanned, odd, skipping = pos + len(buf), b"", b"", 0, 0, True
                            break
                        pos, buf, scanned, odd = pos + nl + 1, buf[nl + 1 :], 0, 0
                        continue
                if end is not None and len(buf) > end - 1 - pos:  # the piece ends in this buffer
                    last = _piece_end(uri, buf, end - 1 - pos, pos)
                    if last >= 0:
                        if last:
                            yield pos, buf[:last]
                        return
                cut = last_record_end(buf, scanned, odd)
                if cut < 0:
                    rest, odd = buf, odd ^ (buf.count(b'"', scanned) & 1)
                    scanned = len(buf)
                    break
                yield pos, buf[:cut]
                rest = buf[cut + 1 :]
                pos += cut + 1
                scanned, odd = len(rest), rest.count(b'"') & 1
                break
    finally:
        f.close()


def _piece_end(uri: str, buf: bytes, at: int, pos: int) -> int:
    """The end of the record of ``buf`` (beginning at a record, at file offset ``pos``) that holds index
    ``at`` or ends there; -1 if it does not end in ``buf``. It must end at the first newline from ``at``,
    where the reader of the next piece begins."""
    found = next_record_end(buf, at, buf.count(b'"', 0, at) & 1)
    if found >= 0 and found != buf.find(b"\n", at):
        raise DataError(
            f"{uri}: a quoted CSV field holding a newline crosses byte {pos + at + 1}, where the file is "
            "cut into pieces for several readers: write the data as at least one file per reader "
            "(world_size x DataLoader workers), each then read whole, or compress it (a .gz file is read "
            "whole), or keep newlines out of quoted fields"
        )
    return found


def last_record_end(buf: bytes, lo: int, odd: int) -> int:
    """The last newline at or after ``lo`` outside double quotes (``odd``: quote parity of ``buf[:lo]``)."""
    cut = buf.rfind(b"\n", lo)
    if cut < 0:
        return -1
    odd ^= buf.count(b'"', lo, cut) & 1
    while odd:  # every newline after the last quote before ``cut`` shares its parity: jump past them
        quote = buf.rfind(b'"', lo, cut)
        if quote < 0:
            return -1
        new = buf.rfind(b"\n", lo, quote)
        if new < 0:
            return -1
        odd ^= buf.count(b'"', new, cut) & 1
        cut = new
    return cut


def next_record_end(buf: bytes, lo: int, odd: int) -> int:
    """The first newline at or after ``lo`` outside double quotes (``odd``: quote parity of ``buf[:lo]``)."""
    while True:
        if odd:
            quote = buf.find(b'"', lo)
            if quote < 0:
                return -1
            lo, odd = quote + 1, 0
        nl = buf.find(b"\n", lo)
        quote = buf.find(b'"', lo, nl if nl >= 0 else len(buf))
        if quote < 0:
            return nl
        lo, odd = quote + 1, 1


def line_lists(
    uri: str,
    compression: str,
    start: int,
    errors: Errors,
    *,
    limit: int = MAX_RECORD_BYTES,
    end: int | None = None,
    file_size: int | None = None,
) -> Iterator[tuple[int, list[bytes]]]:
    """``(offset of lines[0], lines)``: whole lines (newline removed) from ``start``, without copying the
    read buffers (the split is done on each read as it is; only a line crossing reads is joined).

    With ``end`` (a piece of a file): the lines that *begin* in ``[start, end)``; ``start`` may fall inside
    a line, which then belongs to the piece before. ``file_size``: the file's size when known (no metadata
    request to open it).
    """
    f = open_at(uri, compression, start - 1 if start and end is not None else start, end, size=file_size)
    size = min(read_size(uri), limit)
    try:
        pos = start
        pending: list[bytes] = []  # the start of a line that continues in the next read
        held = 0
        skipping = bool(start and end is not None)  # to the first line that begins at or after start
        if skipping:
            pos = start - 1
        while True:
            data = _read(f, size, errors)
            if data is None:  # damaged: the partial record at the damage is the bad one
                return
            if not data:
                if pending and not skipping and (end is None or pos < end):
                    yield pos, [b"".join(pending)]
                return
            if skipping:
                data, pos = _after_newline(data, pos)
                if data is None:
                    continue
                skipping = False
            if end is not None and pos >= end:
                return
            lines = data.split(b"\n")
            rest = lines.pop()
            if lines:
                after = pos + held + len(data) - len(rest)  # the offset after this read's last newline
                if pending:
                    if held + len(lines[0]) > limit:
                        _too_long(uri, compression, pos, limit, "a line", "", errors)
                        pos += held + len(lines.pop(0)) + 1
                    else:
                        pending.append(lines[0])
                        lines[0] = b"".join(pending)
                    pending, held = [], 0
                if end is not None and after > end:  # the piece ends in this read
                    lines = _begun_before(lines, pos, end)
                    if lines:
                        yield pos, lines
                    return
                if lines:
                    yield pos, lines
                pos = after
            if rest:
                pending.append(rest)
                held += len(rest)
                if held > limit:
                    _too_long(uri, compression, pos, limit, "a line", "", errors)
                    pos += held
                    pending, held, skipping = [], 0, True
    finally:
        f.close()


def _begun_before(lines: list[bytes], pos: int, end: int) -> list[bytes]:
    """The first of ``lines`` (the first beginning at ``pos``) that begin before ``end``."""
    for index, line in enumerate(lines):
        if pos >= end:
            return lines[:index]
        pos += len(line) + 1
    return lines


def line_at(uri: str, compression: str, offset: int) -> int:
    """The 1-based number of the line holding byte ``offset`` (for error messages: reads up to it)."""
    f = open_at(uri, compression, 0)
    try:
        line, left = 1, offset
        while left > 0:
            data = f.read(min(READ_SIZE, left))
            if not data:
                break
            line += data.count(b"\n")
            left -= len(data)
        return line
    finally:
        f.close()


def locate(
    uri: str, compression: str, start: int, bad: bytes | Callable[[bytes], bool]
) -> tuple[int, int] | None:
    """``(line number, byte offset)`` of the first line at or after ``start`` that begins ``bad``'s text
    (or for which ``bad(line)`` is true); None if there is none.

    Identical earlier lines would have failed the same way, so the first match is the bad one.
    """
    if isinstance(bad, bytes):
        first = bad.split(b"\n", 1)[0].rstrip(b"\r")
        matches: Callable[[bytes], bool] = lambda line: line.rstrip(b"\r") == first  # noqa: E731
    else:
        matches = bad
    line_no = 1
    f = open_at(uri, compression, 0)
    try:
        offset = 0
        rest = b""
        while True:
            data = f.read(READ_SIZE)
            buf = rest + data
            if data:
                lines = buf.split(b"\n")
                rest = lines.pop()
            else:
                lines = [buf] if buf else []
            for line in lines:
                if offset >= start and matches(line):
                    return line_no, offset
                offset += len(line) + 1
                line_no += 1
            if not data:
                return None
    finally:
        f.close()

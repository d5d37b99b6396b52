"""Line-oriented chunking shared by the JSONL and CSV readers, and finding a bad record's line number."""

from __future__ import annotations

from collections.abc import Iterator

from vertexrt.data._io import READ_SIZE, open_at


def line_chunks(
    uri: str, compression: str, start: int, *, quoted: bool = False
) -> Iterator[tuple[int, bytes]]:
    """``(offset, body)``: whole lines from ``start``; ``body`` ends right before a newline (or at EOF).

    With ``quoted`` a newline inside a double-quoted field (CSV) does not end a record: a chunk is cut only
    where the count of ``"`` characters since ``start`` is even.
    """
    f = open_at(uri, compression, start)
    try:
        pos = start
        rest = b""
        while True:
            data = f.read(READ_SIZE)
            if not data:
                if rest:
                    yield pos, rest
                return
            buf = rest + data if rest else data
            cut = buf.rfind(b"\n")
            if quoted:
                while cut >= 0 and buf.count(b'"', 0, cut) % 2:
                    cut = buf.rfind(b"\n", 0, cut)
            if cut < 0:
                rest = buf
                continue
            rest = buf[cut + 1 :]
            yield pos, buf[:cut]
            pos += cut + 1
    finally:
        f.close()


def locate(uri: str, compression: str, start: int, bad: bytes) -> tuple[int, int]:
    """``(line number, byte offset)`` of the first line at or after ``start`` that begins ``bad``'s text.

    Identical earlier lines would have failed the same way, so the first match is the bad one.
    """
    first = bad.split(b"\n", 1)[0].rstrip(b"\r")
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
                if offset >= start and line.rstrip(b"\r") == first:
                    return line_no, offset
                offset += len(line) + 1
                line_no += 1
            if not data:
                return line_no, offset
    finally:
        f.close()

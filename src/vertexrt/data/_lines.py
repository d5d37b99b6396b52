"""Line-oriented chunking shared by the JSONL and CSV readers, and finding a bad record's line number."""

from __future__ import annotations

from collections.abc import Callable, Iterator

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


def line_lists(uri: str, compression: str, start: int) -> Iterator[tuple[int, list[bytes]]]:
    """``(offset of lines[0], lines)``: whole lines (newline removed) from ``start``, without copying the
    read buffers (the split is done on each read as it is; only a line crossing two reads is joined)."""
    f = open_at(uri, compression, start)
    try:
        pos = start
        rest = b""
        while True:
            data = f.read(READ_SIZE)
            if not data:
                if rest:
                    yield pos, [rest]
                return
            lines = data.split(b"\n")
            consumed = len(rest) + len(data)
            if rest:
                lines[0] = rest + lines[0]
            rest = lines.pop()
            if lines:
                yield pos, lines
                pos += consumed - len(rest)
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

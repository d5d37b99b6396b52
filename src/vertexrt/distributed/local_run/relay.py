"""Replicas' output relayed as it arrives, each line prefixed with the replica's label, and the
launcher's own lines."""

from __future__ import annotations

import re
import sys
import time
from dataclasses import dataclass, field
from typing import BinaryIO

_LINE_END = re.compile(rb"(\r\n|\r|\n)(?=[\s\S])")  # a line end with more output after it
_HOLD_BYTES = 1 << 16  # an unfinished line is held back at most this long...
_HOLD_SECONDS = 0.05  # ... or this long, for its newline (print() writes text and "\n" separately)


@dataclass
class _Stream:
    r"""One replica's output: its unfinished line, whether its next byte starts a line, whether it ended
    on ``\r``."""

    prefix: bytes
    pending: bytearray = field(default_factory=bytearray)
    since: float = 0.0
    at_line_start: bool = True
    after_cr: bool = False


class OutputRelay:
    r"""Relays replicas' output to ``out`` as it arrives, every line prefixed with the replica's label.

    ``\r`` ends a line as ``\n`` does, so each redraw of a progress bar keeps its prefix. An unfinished line
    waits for its end at most 64 KiB or 50 ms (call :meth:`flush`), then is written as it is; when another
    replica writes while such a line is open on ``out``, that line is closed first. Work is linear in the
    output and memory bounded by 64 KiB per replica.

    Example:
        >>> import io
        >>> out = io.BytesIO()
        >>> relay = OutputRelay(out)
        >>> relay.feed("workerpool0-0", b"10%\r20%")
        >>> relay.flush(older_than=0)
        >>> relay.feed("workerpool1-0", b"ready\n")
        >>> out.getvalue()
        b'[workerpool0-0] 10%\r[workerpool0-0] 20%\n[workerpool1-0] ready\n'
    """

    def __init__(self, out: BinaryIO) -> None:
        self.out = out
        self._streams: dict[str, _Stream] = {}
        self._open: _Stream | None = None  # the stream whose line is unfinished on `out`
        self._last: _Stream | None = None  # the stream written last

    def feed(self, label: str, chunk: bytes) -> None:
        """Relay ``chunk`` of ``label``'s output: its finished lines now, an unfinished one held back."""
        stream = self._streams.setdefault(label, _Stream(f"[{label}] ".encode()))
        if stream.after_cr and not stream.pending and chunk[:1] == b"\n":  # \r\n split between two reads
            chunk = chunk[1:]
            if self._last is stream:
                self._write(b"\n")
        end = max(chunk.rfind(b"\n"), chunk.rfind(b"\r")) + 1
        if end:
            self._emit(stream, bytes(stream.pending) + chunk[:end])
            stream.pending.clear()
        if end < len(chunk):
            if not stream.pending:
                stream.since = time.monotonic()
            stream.pending += chunk[end:]
            if len(stream.pending) >= _HOLD_BYTES:
                self._emit_pending(stream)

    def flush(self, older_than: float = _HOLD_SECONDS) -> None:
        """Write every unfinished line held back for ``older_than`` seconds or more."""
        now = time.monotonic()
        for stream in self._streams.values():
            if stream.pending and now - stream.since >= older_than:
                self._emit_pending(stream)

    def interrupt(self) -> None:
        """Close the line open on ``out``, so that something else can be written there."""
        if self._open is not None:
            self._write(b"\n")
            self._open.at_line_start = True
            self._open = None

    def close(self, label: str) -> None:
        """``label``'s output ended: write what is held back and finish its line."""
        stream = self._streams.pop(label, None)
        if stream is None:
            return
        self._emit_pending(stream)
        if self._open is stream:
            self.interrupt()

    def _emit_pending(self, stream: _Stream) -> None:
        if stream.pending:
            self._emit(stream, bytes(stream.pending))
            stream.pending.clear()

    def _emit(self, stream: _Stream, data: bytes) -> None:
        if self._open is not stream:
            self.interrupt()
        head = stream.prefix if stream.at_line_start else b""
        self._write(head + _LINE_END.sub(lambda m: m.group(1) + stream.prefix, data))
        stream.at_line_start = data.endswith((b"\n", b"\r"))
        stream.after_cr = data.endswith(b"\r")
        self._open = None if stream.at_line_start else stream
        self._last = stream

    def _write(self, data: bytes) -> None:
        self.out.write(data)
        self.out.flush()


def say(message: str) -> None:
    """A line of the launcher's own, on stderr."""
    print(f"[local-run] {message}", file=sys.stderr, flush=True)

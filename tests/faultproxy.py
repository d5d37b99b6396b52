"""A fault-injecting HTTP/1.1 proxy on loopback, for putting a misbehaving network in front of a server.

Each request is read whole, then handled by the proxy's current mode:

- ``pass``: forwarded to the upstream server, and its response relayed back;
- ``stall``: accepted and never answered (the connection stays open until the client gives up);
- ``reset``: the connection is reset (RST) without an answer;
- ``cut``: forwarded, then the connection is reset halfway through relaying the response;
- ``503``: answered ``503 Service Unavailable`` (a JSON error body, the connection kept alive).

The mode is switched at runtime with :meth:`FaultProxy.set`, optionally for the next ``count`` requests only,
or only for requests (the raw bytes: request line, headers, body) that match a regular expression.
Requests are handled per request, not per connection, so a pooled keep-alive connection sees a switch too.

Example:
    >>> with FaultProxy(("127.0.0.1", 4443)) as proxy:
    ...     os.environ["STORAGE_EMULATOR_HOST"] = proxy.endpoint
    ...     proxy.set("503", count=2)  # the next two requests fail, then everything passes again
"""

from __future__ import annotations

import re
import socket
import struct
import threading
from collections import Counter
from typing import BinaryIO

MODES = ("pass", "stall", "reset", "cut", "503")
_503 = b'{"error": {"code": 503, "message": "injected by FaultProxy"}}'


class FaultProxy:
    """Listens on ``127.0.0.1`` (a free port); ``endpoint`` is its ``http://`` URL."""

    def __init__(self, upstream: tuple[str, int]) -> None:
        self.upstream = upstream
        self.handled: Counter[str] = Counter()  # requests per mode applied
        self.forwarded: list[tuple[str, int]] = []  # (request line, response bytes) of each relayed request
        self._mode = "pass"
        self._count: int | None = None
        self._match: re.Pattern[bytes] | None = None
        self._lock = threading.Lock()
        self._sockets: set[socket.socket] = set()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.endpoint = f"http://127.0.0.1:{self._listener.getsockname()[1]}"
        self._closed = threading.Event()

    def start(self) -> FaultProxy:
        threading.Thread(target=self._accept, name="faultproxy-accept", daemon=True).start()
        return self

    def set(self, mode: str, count: int | None = None, match: str | None = None) -> None:
        """Apply ``mode`` to every request from now on, or to the next ``count`` requests, then ``pass``.

        With ``match``, only requests whose raw bytes match that regular expression count; others pass.
        """
        if mode not in MODES:
            raise ValueError(f"mode {mode!r}: expected one of {MODES}")
        with self._lock:
            self._mode, self._count = mode, count
            self._match = re.compile(match.encode(), re.DOTALL) if match else None

    def stop(self) -> None:
        """Stop listening and drop every open connection."""
        self._closed.set()
        self._listener.close()
        with self._lock:
            sockets, self._sockets = list(self._sockets), set()
        for sock in sockets:
            _reset(sock)

    def __enter__(self) -> FaultProxy:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def _next_mode(self, request: bytes) -> str:
        with self._lock:
            if self._match is not None and not self._match.search(request):
                self.handled["pass"] += 1
                return "pass"
            mode = self._mode
            if self._count is not None:
                self._count -= 1
                if self._count <= 0:
                    self._mode, self._count, self._match = "pass", None, None
            self.handled[mode] += 1
            return mode

    def _track(self, sock: socket.socket) -> bool:
        with self._lock:
            if self._closed.is_set():
                return False
            self._sockets.add(sock)
            return True

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            if self._track(client):
                threading.Thread(target=self._serve, args=(client,), daemon=True).start()
            else:
                client.close()

    def _serve(self, client: socket.socket) -> None:
        upstream: socket.socket | None = None
        upstream_reader: BinaryIO | None = None
        reader = client.makefile("rb")
        try:
            while True:
                request = _read_message(reader)
                if request is None:
                    return
                mode = self._next_mode(request)
                if mode == "stall":
                    while client.recv(65536):  # hold the connection until the client gives up
                        pass
                    return
                if mode == "reset":
                    _reset(client)
                    return
                if mode == "503":
                    client.sendall(
                        b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
                        + f"Content-Length: {len(_503)}\r\n\r\n".encode()
                        + _503
                    )
                    continue
                if upstream is None or upstream_reader is None:
                    upstream = socket.create_connection(self.upstream)
                    if not self._track(upstream):
                        return
                    upstream_reader = upstream.makefile("rb")
                upstream.sendall(request)
                response = _read_message(upstream_reader, head=request.startswith(b"HEAD "))
                if response is None:
                    return
                if mode == "cut":
                    client.sendall(response[: len(response) // 2])
                    _reset(client)
                    return
                client.sendall(response)
                with self._lock:
                    self.forwarded.append((request.split(b"\r\n", 1)[0].decode("latin-1"), len(response)))
        except OSError:
            return
        finally:
            for stream in (reader, upstream_reader):
                if stream is not None:
                    stream.close()
            for sock in (client, upstream):
                if sock is not None:
                    sock.close()
                    with self._lock:
                        self._sockets.discard(sock)


def _reset(sock: socket.socket) -> None:
    """Close with an RST rather than a FIN (SO_LINGER with a zero timeout)."""
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        sock.close()
    except OSError:
        pass


def _read_message(reader: BinaryIO, head: bool = False) -> bytes | None:
    """One whole HTTP/1.1 request or response (start line, headers, body) as raw bytes; None at EOF."""
    start = reader.readline(65537)
    if not start:
        return None
    parts = [start]
    headers = {}
    while True:
        line = reader.readline(65537)
        if not line:
            raise ConnectionError("connection closed inside the HTTP headers")
        parts.append(line)
        if line in (b"\r\n", b"\n"):
            break
        name, _, value = line.decode("latin-1").partition(":")
        headers[name.strip().lower()] = value.strip().lower()
    status = start.split(b" ", 2)[1] if start.startswith(b"HTTP/") else b""
    if head or status in (b"204", b"304") or status.startswith(b"1"):
        return b"".join(parts)
    if "chunked" in headers.get("transfer-encoding", ""):
        while True:
            size_line = reader.readline(65537)
            parts.append(size_line)
            size = int(size_line.split(b";")[0], 16)
            if size == 0:
                while (trailer := reader.readline(65537)) not in (b"\r\n", b"\n", b""):
                    parts.append(trailer)
                parts.append(b"\r\n")
                break
            parts.append(_read_exact(reader, size + 2))
    elif "content-length" in headers:
        parts.append(_read_exact(reader, int(headers["content-length"])))
    elif status:  # a response without a length ends when the server closes
        parts.append(reader.read())
    return b"".join(parts)


def _read_exact(reader: BinaryIO, size: int) -> bytes:
    data = reader.read(size)
    if len(data) != size:
        raise ConnectionError(f"connection closed after {len(data)} of {size} body bytes")
    return data

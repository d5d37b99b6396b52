"""A counting HTTP/1.1 proxy in front of the Cloud Storage test server: what each rank asks of storage.

Every request is forwarded to the upstream server and recorded as ``(tag, kind, method, bytes)``:

- ``tag``: who asked: the ``X-Scale-Tag`` request header when present (e.g. ``"restore/17"``), else the
  label of the listening port the request came in on (one port per rank, see :meth:`CountingProxy.listen`);
- ``kind``: ``list``, ``metadata``, ``read``, ``write`` or ``delete``, from the JSON API's method and path;
- ``bytes``: request body + response body.

``delay`` adds a fixed latency to every request (the simulation's 1 ms per request). In its own process
(:class:`ProxyProcess`, which runs this file) its threads and buffers stay out of the measured process's CPU
and allocations; its records are then read over HTTP (``GET /__countingproxy__/records``).

Example:
    >>> with CountingProxy(("127.0.0.1", server.port), delay=0.001) as proxy:
    ...     endpoint = proxy.listen("rank0")
    ...     ...  # point STORAGE_EMULATOR_HOST at endpoint
    ...     proxy.records()  # [Record(tag='rank0', kind='list', method='GET', bytes=312, target=...), ...]
"""

from __future__ import annotations

import http.client
import json
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, NamedTuple
from urllib.parse import unquote, urlsplit

TAG_HEADER = "X-Scale-Tag"
KINDS = ("list", "metadata", "read", "write", "delete")
CONTROL = "/__countingproxy__/"
_HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "content-length", "proxy-connection"}


class Record(NamedTuple):
    tag: str
    kind: str
    method: str
    bytes: int
    target: str  # the request's path and query


def classify(method: str, target: str) -> str:
    """The kind of one Cloud Storage JSON API request (``target`` is the request line's path and query)."""
    url = urlsplit(target)
    path, query = unquote(url.path), url.query
    if method == "DELETE":
        return "delete"
    if method in ("POST", "PUT", "PATCH"):
        return "write"  # uploads, rewrite/copy/compose, metadata patches: all object writes
    if "alt=media" in query or path.startswith("/download/"):
        return "read"
    if path.rstrip("/").endswith("/o"):
        return "list"
    return "metadata"


class CountingProxy:
    """Forwards to ``upstream`` from any number of loopback ports; thread-safe record keeping."""

    def __init__(self, upstream: tuple[str, int], delay: float = 0.0) -> None:
        self.upstream = upstream
        self.delay = delay
        self._records: list[Record] = []
        self._lock = threading.Lock()
        self._servers: list[_Server] = []

    def listen(self, label: str = "") -> str:
        """A new port (its ``http://`` URL) whose requests without a tag header are recorded as ``label``."""
        proxy = self

        class Handler(_Forwarder):
            default_tag = label
            owner = proxy

        server = _Server(("127.0.0.1", 0), Handler)
        server.daemon_threads = True
        server.request_queue_size = 1024
        threading.Thread(target=server.serve_forever, name=f"countingproxy-{label}", daemon=True).start()
        self._servers.append(server)
        return f"http://127.0.0.1:{server.server_address[1]}"

    def record(self, record: Record) -> None:
        with self._lock:
            self._records.append(record)

    def records(self) -> list[Record]:
        with self._lock:
            return list(self._records)

    def clear(self) -> None:
        with self._lock:
            self._records.clear()

    def stop(self) -> None:
        for server in self._servers:
            server.shutdown()
            server.server_close()
        self._servers.clear()

    def __enter__(self) -> CountingProxy:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


class _Server(ThreadingHTTPServer):
    def handle_error(self, request: Any, client_address: Any) -> None:
        if not isinstance(sys.exc_info()[1], OSError):  # a client that reset its connection is no news
            super().handle_error(request, client_address)


class _Forwarder(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive: one upstream connection per client connection
    default_tag = ""
    owner: CountingProxy

    def setup(self) -> None:
        super().setup()
        self._upstream: http.client.HTTPConnection | None = None

    def finish(self) -> None:
        if self._upstream is not None:
            self._upstream.close()
        super().finish()

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base class's name
        pass

    def _forward(self) -> None:
        body = b"".join(self._body())
        if self.path.startswith(CONTROL):
            self._control()
            return
        headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP_BY_HOP}
        tag = headers.pop(TAG_HEADER, None) or self.default_tag
        if body or self.command in ("POST", "PUT", "PATCH"):
            headers["Content-Length"] = str(len(body))
        if self.owner.delay:
            time.sleep(self.owner.delay)
        if self._upstream is None:
            self._upstream = http.client.HTTPConnection(*self.owner.upstream, timeout=300)
        self._upstream.request(self.command, self.path, body=body, headers=headers)
        response = self._upstream.getresponse()
        payload = response.read()
        self.send_response_only(response.status, response.reason)
        for name, value in response.getheaders():
            if name.lower() not in _HOP_BY_HOP:
                self.send_header(name, value)
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        kind = classify(self.command, self.path)
        self.owner.record(Record(tag, kind, self.command, len(body) + len(payload), self.path))
        if self.command != "HEAD":
            try:
                self.wfile.write(payload)
            except OSError:  # the client went away (its session closed): nothing to relay to
                self.close_connection = True

    def _control(self) -> None:
        if self.path == CONTROL + "clear":
            self.owner.clear()
        payload = json.dumps(self.owner.records()).encode() if self.path == CONTROL + "records" else b"{}"
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def _body(self) -> Iterator[bytes]:
        if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
            while size := int(self.rfile.readline().split(b";")[0], 16):
                yield self.rfile.read(size)
                self.rfile.readline()
            while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                pass
            return
        length = int(self.headers.get("Content-Length") or 0)
        if length:
            yield self.rfile.read(length)

    do_GET = do_POST = do_PUT = do_PATCH = do_DELETE = do_HEAD = _forward


class ProxyProcess:
    """A :class:`CountingProxy` with one port, in a child process; ``endpoint`` is its URL."""

    def __init__(self, upstream: tuple[str, int], delay: float = 0.0, label: str = "") -> None:
        self._process = subprocess.Popen(
            [sys.executable, __file__, upstream[0], str(upstream[1]), str(delay), label],
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self._process.stdout is not None
        self.endpoint = self._process.stdout.readline().strip()
        if not self.endpoint:
            raise RuntimeError(f"the counting proxy exited with {self._process.wait()}")

    def records(self) -> list[Record]:
        return [Record(*fields) for fields in json.loads(self._ask("records"))]

    def clear(self) -> None:
        self._ask("clear")

    def stop(self) -> None:
        self._process.terminate()
        self._process.wait()

    def __enter__(self) -> ProxyProcess:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def _ask(self, what: str) -> bytes:
        host, port = self.endpoint.removeprefix("http://").split(":")
        connection = http.client.HTTPConnection(host, int(port), timeout=300)
        try:
            connection.request("GET", CONTROL + what)
            return connection.getresponse().read()
        finally:
            connection.close()


if __name__ == "__main__":  # python countingproxy.py HOST PORT DELAY LABEL: serve until terminated
    try:  # Linux: end with the process that started it, however it ends (PR_SET_PDEATHSIG, SIGKILL)
        import ctypes

        ctypes.CDLL("libc.so.6").prctl(1, 9)
    except (OSError, AttributeError):
        pass
    proxy = CountingProxy((sys.argv[1], int(sys.argv[2])), delay=float(sys.argv[3]))
    print(proxy.listen(sys.argv[4]), flush=True)
    threading.Event().wait()

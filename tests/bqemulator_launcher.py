"""Start the ``bqemulator`` BigQuery emulator (REST + gRPC Storage Read) offline, for tests and benchmarks.

Runs under the emulator's own virtual environment (``.venv/bqemu``, made by ``make install``): the wheel's
pytest plugin would crash pytest in the test venv. Patches applied before the package's CLI runs:

* DuckDB's ``spatial`` extension is not downloaded at startup (no internet; GEOGRAPHY is the only loss).
* ``VERTEXRT_BQEMU_HONOUR_OFFSET=1``: ``ReadRows`` starts at the request's ``offset`` and reports
  ``stats.progress.at_response_start`` as real BigQuery does (as shipped it re-sends from row 0).
* ``VERTEXRT_BQEMU_FAIL_TABLE=NAME``: the first read of each stream of table ``NAME`` fails with
  ``UNAVAILABLE`` after one message (a stream that breaks mid-read).
* A table named ``fail_<code>`` (``fail_resource_exhausted``, ``fail_permission_denied``, ...): the first
  read of each of its streams sends one message, then ends with gRPC status ``<CODE>``.
* ``VERTEXRT_BQEMU_STALL_TABLE=NAME``: the first read of each stream of table ``NAME`` sends one message,
  then neither a message nor a status until the client reads that stream again, which it does only after
  giving up on this call (a stream that stalls mid-read).
* ``VERTEXRT_BQEMU_RESPLIT_TABLE=NAME``: every new read session of table ``NAME`` splits it into streams at
  other row boundaries than the session before (real BigQuery promises no split across sessions).
* ``tabledata.list`` pages in the table's row order, each page query on a DuckDB cursor of its own (as
  shipped, ``LIMIT/OFFSET`` with no ``ORDER BY`` on the one shared connection: concurrent pages could fetch
  each other's rows, so readers saw duplicates and missed rows).
* Each ``ReadRows`` request is logged as ``{"event": "vertexrt.read_rows", "stream": ..., "offset": ...}``.

Example:
    .venv/bqemu/bin/python tests/bqemulator_launcher.py start --rest-port 0 --grpc-port 0 --log-level info
"""

from __future__ import annotations

import copy
import json
import os
import re
import signal
import threading
from collections.abc import Iterator
from typing import Any

_TABLE = r'"[^"]+"\."[^"]+"'
_TABLEDATA_PAGE = re.compile(rf"(?P<select>SELECT .+ FROM {_TABLE}) (?P<limit>LIMIT \d+ OFFSET \d+)", re.S)
_TABLEDATA_COUNT = re.compile(rf"SELECT COUNT\(\*\) FROM {_TABLE}")


def _patch() -> None:
    import grpc
    from bqemulator.grpc_api import read_servicer
    from bqemulator.storage import engine
    from bqemulator.streaming import read_session
    from google.cloud.bigquery_storage_v1 import types

    engine.DuckDBEngine._load_spatial = lambda self: None  # type: ignore[method-assign]
    original_fetch = engine.DuckDBEngine.fetch_arrow
    original_execute = engine.DuckDBEngine.execute

    # tabledata.list runs its page query and its COUNT(*) on the one shared DuckDB connection, from the
    # server's thread pool: two pages at once could each fetch the other's result. They get a cursor of
    # their own (the same database), and the page its rows in the table's order.
    def fetch_arrow(self: Any, sql: str, parameters: Any = None) -> Any:
        page = _TABLEDATA_PAGE.fullmatch(sql.strip())
        if page is None:
            return original_fetch(self, sql, parameters)
        own = copy.copy(self)
        own._connection = self.connection.cursor()
        try:
            return original_fetch(own, f"{page['select']} ORDER BY rowid {page['limit']}", parameters)
        finally:
            own._connection.close()

    def execute(self: Any, sql: str, parameters: Any = None) -> Any:
        if _TABLEDATA_COUNT.fullmatch(sql.strip()):
            return self.connection.cursor().execute(sql)
        return original_execute(self, sql, parameters)

    engine.DuckDBEngine.fetch_arrow = fetch_arrow  # type: ignore[method-assign]
    engine.DuckDBEngine.execute = execute  # type: ignore[method-assign]

    # Each ReadRows stream runs on a thread of the server's pool for as long as it is open, and a stream a
    # client abandoned (a resume test stops mid-stream) keeps its thread: with the default pool (6 threads
    # on 2 cores) the server wedges after six. Give the synchronous handlers a pool of their own.
    from concurrent.futures import ThreadPoolExecutor

    import grpc.aio

    original_server = grpc.aio.server

    def server(*args: Any, **kwargs: Any) -> Any:
        kwargs.setdefault("migration_thread_pool", ThreadPoolExecutor(64, thread_name_prefix="bqemu-rpc"))
        return original_server(*args, **kwargs)

    grpc.aio.server = server

    honour = os.environ.get("VERTEXRT_BQEMU_HONOUR_OFFSET") == "1"
    flaky = os.environ.get("VERTEXRT_BQEMU_FAIL_TABLE", "")
    stall = os.environ.get("VERTEXRT_BQEMU_STALL_TABLE", "")
    resplit = os.environ.get("VERTEXRT_BQEMU_RESPLIT_TABLE", "")
    splits: dict[str, int] = {}  # table path -> sessions created on it
    tables: dict[str, str] = {}  # session name -> table path
    failed: set[str] = set()
    stalled: dict[str, threading.Event] = {}  # stream -> set when the client comes back for it
    local = threading.local()
    original_get = read_servicer.get_stream_data
    original_create = read_servicer.BigQueryReadHandler._handle_create_read_session
    original_read = read_servicer.BigQueryReadHandler._handle_read_rows

    def get_stream_data(session_name: str, stream_name: str) -> Any:
        data = original_get(session_name, stream_name)
        local.total = 0 if data is None else data.num_rows
        if data is not None and honour:
            return data.slice(min(local.offset, data.num_rows))
        return data

    def create(self: Any, request_bytes: bytes, context: grpc.ServicerContext) -> bytes:
        answer: bytes = original_create(self, request_bytes, context)
        if answer:
            session = types.ReadSession.deserialize(answer)
            tables[session.name] = session.table
            if resplit and session.table.endswith(f"/{resplit}"):
                _shift(read_session.get_session(session.name), splits.get(session.table, 0))
                splits[session.table] = splits.get(session.table, 0) + 1
        return answer

    def read_rows(self: Any, request_bytes: bytes, context: grpc.ServicerContext) -> Iterator[bytes]:
        request = types.ReadRowsRequest.deserialize(request_bytes)
        local.offset = int(request.offset)
        event = {"event": "vertexrt.read_rows", "stream": request.read_stream, "offset": local.offset}
        os.write(1, json.dumps(event).encode() + b"\n")  # one write: server threads log concurrently
        session = "/".join(request.read_stream.split("/")[:-2])
        table = tables.get(session, "").rsplit("/", 1)[-1]
        code = grpc.StatusCode.UNAVAILABLE if flaky and table == flaky else None
        if table.startswith("fail_"):
            code = getattr(grpc.StatusCode, table.removeprefix("fail_").upper(), None)
        fail = code is not None and request.read_stream not in failed
        if request.read_stream in stalled:
            stalled[request.read_stream].set()
        hang = (
            bool(stall)
            and tables.get(session, "").endswith(f"/{stall}")
            and request.read_stream not in stalled
        )
        sent = local.offset if honour else 0
        for n, message in enumerate(original_read(self, request_bytes, context)):
            if hang and n == 1:
                # Silent until the client gives up and reads the stream again (context.add_callback does not
                # fire on a cancel while a sync handler blocks; the retry is the sign the call was dropped).
                stalled[request.read_stream] = threading.Event()
                stalled[request.read_stream].wait()
                return
            if fail and n == 1:
                # Not context.abort(): from the handler's thread it races the server's send of the previous
                # message (GRPC_CALL_ERROR_TOO_MANY_OPERATIONS), the status is lost and the client waits for
                # good. A status set before returning goes out after the last message.
                failed.add(request.read_stream)
                context.set_code(code)
                context.set_details(f"injected: stream broke mid-read with {code.name}")
                return
            if honour:
                response = types.ReadRowsResponse.deserialize(message)
                total = max(1, local.total)
                response.stats.progress.at_response_start = sent / total
                sent += int(response.row_count)
                response.stats.progress.at_response_end = sent / total
                message = types.ReadRowsResponse.serialize(response)
            yield message

    read_servicer.get_stream_data = get_stream_data
    read_servicer.BigQueryReadHandler._handle_create_read_session = create  # type: ignore[method-assign]
    read_servicer.BigQueryReadHandler._handle_read_rows = read_rows  # type: ignore[method-assign]


def _shift(state: Any, n: int) -> None:
    """Move the inner stream boundaries of session ``state`` by ``n`` x 7919 rows (within each chunk)."""
    streams = state.streams
    rows = streams[-1].end_row if streams else 0
    chunk = rows // max(1, len(streams))
    if len(streams) < 2 or chunk < 2:
        return
    shift = (n * 7919) % chunk
    for i in range(1, len(streams)):
        streams[i].start_row = streams[i - 1].end_row = i * chunk + shift


def _die_with_parent() -> None:
    """Ask Linux to SIGKILL this server when the process that started it dies. Done here, after exec, and not
    in a ``preexec_fn``: that makes Popen fork() (not vfork) a parent holding gRPC client threads, whose fork
    handlers then ran in the child and killed it before exec ("epoll_wait error: Bad file descriptor")."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass  # not Linux: stop() remains the way to end it


def main() -> None:
    _die_with_parent()
    os.environ.setdefault("BQEMU_ENABLE_FORMAT_EXTENSIONS", "false")
    _patch()
    from bqemulator.cli import main as cli

    cli()


class BigQueryEmulator:
    """The launcher in a subprocess of the emulator's venv: free ports read from its JSON log (a file),
    ``/readyz`` as the readiness probe, stopped with SIGTERM then SIGKILL.

    Example:
        >>> with BigQueryEmulator(".venv/bqemu/bin/python", "/tmp/bq.log") as emu:
        ...     os.environ["BIGQUERY_EMULATOR_HOST"] = emu.rest_endpoint
    """

    def __init__(
        self,
        python: str,
        log_path: str,
        honour_offset: bool = False,
        fail_table: str = "",
        stall_table: str = "",
        resplit_table: str = "",
    ):
        self.python = python
        self.log_path = log_path
        self.env = {
            "VERTEXRT_BQEMU_HONOUR_OFFSET": "1" if honour_offset else "0",
            "VERTEXRT_BQEMU_FAIL_TABLE": fail_table,
            "VERTEXRT_BQEMU_STALL_TABLE": stall_table,
            "VERTEXRT_BQEMU_RESPLIT_TABLE": resplit_table,
        }
        self.rest_endpoint = ""
        self.grpc_endpoint = ""
        self._process: Any = None

    def start(self, timeout: float = 60.0) -> BigQueryEmulator:
        import subprocess
        import time
        import urllib.request

        command = [self.python, __file__, "start", "--rest-port", "0", "--grpc-port", "0"]
        command += ["--log-level", "info", "--log-format", "json"]
        env = {**os.environ, **self.env, "BQEMU_ENABLE_FORMAT_EXTENSIONS": "false"}
        with open(self.log_path, "ab") as log:
            start_at = log.tell()
            self._process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + timeout
        ports: dict[str, int] = {}
        while True:
            if self._process.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"bqemulator did not start; see {self.log_path}")
            with open(self.log_path, "rb") as log:
                log.seek(start_at)
                for line in log:
                    if line.startswith(b"{") and b".listen" in line:
                        event = json.loads(line)
                        ports[event["event"]] = int(event["port"])
            if len(ports) == 2:
                self.rest_endpoint = f"http://127.0.0.1:{ports['rest.listen']}"
                self.grpc_endpoint = f"127.0.0.1:{ports['grpc.listen']}"
                try:
                    with urllib.request.urlopen(f"{self.rest_endpoint}/readyz", timeout=2) as answer:
                        if answer.status == 200:
                            return self
                except OSError:
                    pass
            time.sleep(0.05)

    def stop(self, grace: float = 10.0) -> None:
        """SIGTERM, then SIGKILL if it lingers (an abandoned ReadRows stream blocks a clean exit)."""
        from vertexrt.emulator import terminate

        process, self._process = self._process, None
        terminate(process, grace)

    def __enter__(self) -> BigQueryEmulator:
        return self.start() if self._process is None else self

    def __exit__(self, *exc: object) -> None:
        self.stop()


if __name__ == "__main__":
    main()

"""BigQuery Storage Read API: one read session per job, its streams read as Arrow from a (stream, row) cursor.

The chief creates one session with ``N`` streams; the stream names reach every rank through the world
model (``torch.distributed`` broadcast when a process group is up), so all ranks read the same session and
each reader takes its own streams. A reader's position is the row offset inside its stream, so resume is
exact. What the server gets wrong is handled here:

* a server that ignores ``ReadRows.offset`` (re-sends from row 0, as the ``bqemulator`` does) is detected
  by its progress stats and the rows before the offset are skipped locally, checked by count;
* a stream that fails mid-read is reopened from the last row delivered (bounded retries);
* a stream that stalls (no message and no status for ``idle_timeout`` seconds while the reader waits) is
  cancelled and reopened the same way;
* a session past its expiry (6 h) is replaced by a new one with the same options, and a warning says so.

How the ranks share one session and how a data state keeps it (so a restart reads the same streams again)
is ``vertexrt.data.bigquery_session``.

``STORAGE_READ_EMULATOR_HOST`` (``host:port``) points the client at a local gRPC server, insecure. With
``BIGQUERY_EMULATOR_HOST`` set and no ``STORAGE_READ_EMULATOR_HOST`` the API counts as unavailable (a REST
emulator: the table is read with ``list_rows``, nothing goes to Google).

Example:
    >>> streams = create_session(parse_table("bq://p.d.t"), streams=8, columns=["x"], row_filter="x > 0")
    >>> for offset, batch in read_stream(streams[0], 0): ...
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Any

from vertexrt.data.sources import TableSource
from vertexrt.errors import DataError

logger = logging.getLogger(__name__)

SESSION_LIFETIME = 6 * 3600.0
"""Seconds a read session lives when the server reports no expiry (BigQuery's documented 6 hours)."""
EXPIRY_MARGIN = 60.0
RETRIES = 5
IDLE_TIMEOUT = 120.0
"""Seconds a reader waits for the next ``ReadRows`` message before it cancels the stream and reopens it."""
CALL_TIMEOUT = 3600.0


class StorageUnavailable(DataError):
    """The Storage Read API cannot be used here (not enabled, not reachable): read with ``list_rows``."""


@dataclass(frozen=True)
class StreamSource:
    """One stream of a read session: what a reader reads; its positions are row offsets in the stream."""

    table_id: str
    session: str
    stream: str
    index: int
    streams: int
    expires: float
    schema: bytes
    columns: tuple[str, ...] | None = None
    row_filter: str | None = None
    project: str | None = None

    @property
    def uri(self) -> str:
        return f"bq://{self.table_id} (stream {self.index} of {self.streams})"


_CLIENTS: dict[tuple[int, str | None], Any] = {}
_RENEWED: dict[str, list[StreamSource]] = {}


def read_client() -> Any:
    """This process's low-level Storage Read client (no automatic stream resume: the reader owns it)."""
    host = os.environ.get("STORAGE_READ_EMULATOR_HOST", "").strip() or None
    key = (os.getpid(), host)
    if key not in _CLIENTS:
        from google.cloud.bigquery_storage_v1.services.big_query_read import BigQueryReadClient

        if host:
            import grpc
            from google.cloud.bigquery_storage_v1.services.big_query_read.transports import (
                BigQueryReadGrpcTransport,
            )

            channel = grpc.insecure_channel(host, options=[("grpc.max_receive_message_length", -1)])
            _CLIENTS[key] = BigQueryReadClient(transport=BigQueryReadGrpcTransport(channel=channel))
        else:
            _CLIENTS[key] = BigQueryReadClient()
    return _CLIENTS[key]


def create_session(
    table: TableSource,
    streams: int,
    columns: Sequence[str] | None = None,
    row_filter: str | None = None,
    project: str | None = None,
    timeout: float = 120.0,
) -> list[StreamSource]:
    """A new Arrow read session on ``table`` with up to ``streams`` streams (the server may grant fewer).

    Raises:
        DataError: the table does not exist or cannot be read, or there are no credentials (names the
            table and the fix).
        StorageUnavailable: the API is not enabled or not reachable (use ``list_rows``).
    """
    if (
        os.environ.get("BIGQUERY_EMULATOR_HOST", "").strip()
        and not os.environ.get("STORAGE_READ_EMULATOR_HOST", "").strip()
    ):
        raise StorageUnavailable(
            f"bq://{table.table_id}: BIGQUERY_EMULATOR_HOST is set and STORAGE_READ_EMULATOR_HOST is not, so "
            "the Storage Read API is not emulated (set STORAGE_READ_EMULATOR_HOST=host:port to use it)"
        )
    from google.api_core import exceptions as gexc
    from google.api_core.retry import Retry
    from google.auth.exceptions import DefaultCredentialsError
    from google.cloud.bigquery_storage_v1 import types

    from vertexrt.env import project_id

    options = types.ReadSession.TableReadOptions(
        selected_fields=list(columns or []), row_restriction=row_filter or ""
    )
    request = types.ReadSession(
        table=f"projects/{table.project}/datasets/{table.dataset}/tables/{table.table}",
        data_format=types.DataFormat.ARROW,
        read_options=options,
    )
    try:
        session = read_client().create_read_session(
            parent=f"projects/{project_id(project)}",
            read_session=request,
            max_stream_count=max(1, streams),
            retry=Retry(initial=0.2, maximum=5.0, timeout=timeout),
            timeout=timeout,
        )
    except DefaultCredentialsError as err:
        raise DataError(
            f"bq://{table.table_id}: no Google credentials for the Storage Read API ({err}); run the job "
            "with a service account, or locally `gcloud auth application-default login`"
        ) from None
    except (gexc.NotFound, gexc.InvalidArgument) as err:
        raise DataError(
            f"bq://{table.table_id}: cannot open a read session ({type(err).__name__}: {err.message}); "
            "check the table name, the columns and the row filter"
        ) from None
    except gexc.PermissionDenied as err:
        if "has not been used" in str(err) or "SERVICE_DISABLED" in str(err) or "is disabled" in str(err):
            raise StorageUnavailable(f"bq://{table.table_id}: the Storage Read API is not enabled") from None
        raise DataError(
            f"bq://{table.table_id}: permission denied ({err.message}); grant the job's service account "
            "roles/bigquery.readSessionUser on the project and roles/bigquery.dataViewer on the table"
        ) from None
    except (gexc.GoogleAPICallError, gexc.RetryError) as err:
        raise StorageUnavailable(
            f"bq://{table.table_id}: the Storage Read API failed ({type(err).__name__}: {err})"
        ) from None
    expires = session.expire_time.timestamp() if session.expire_time else time.time() + SESSION_LIFETIME
    return [
        StreamSource(
            table_id=table.table_id,
            session=session.name,
            stream=stream.name,
            index=i,
            streams=len(session.streams),
            expires=expires,
            schema=bytes(session.arrow_schema.serialized_schema),
            columns=tuple(columns) if columns is not None else None,
            row_filter=row_filter,
            project=project,
        )
        for i, stream in enumerate(session.streams)
    ]


def _renewed(source: StreamSource, why: str) -> StreamSource:
    """The same stream index in a fresh session with the same options (one new session per process)."""
    fresh = _RENEWED.get(source.session)
    if fresh is None:
        from vertexrt.data.sources import parse_table

        fresh = create_session(
            parse_table(source.table_id), source.streams, source.columns, source.row_filter, source.project
        )
        _RENEWED[source.session] = fresh
        logger.warning(
            "bq://%s: read session %s %s; created session %s and continue each stream at its row offset "
            "(if BigQuery split the table differently, rows of this epoch may repeat or be missed)",
            source.table_id,
            source.session,
            why,
            fresh[0].session if fresh else "(no streams)",
        )
    if source.index >= len(fresh):
        raise DataError(
            f"{source.uri}: the new read session has only {len(fresh)} streams; restart the epoch"
        )
    return replace(fresh[source.index], streams=source.streams)


def read_stream(
    source: StreamSource, offset: int, idle_timeout: float = IDLE_TIMEOUT
) -> Iterator[tuple[int, Any]]:
    """``(row offset, pyarrow.RecordBatch)`` of ``source`` from row ``offset`` to the end of the stream.

    Example:
        >>> rows = sum(batch.num_rows for _, batch in read_stream(streams[0], 0, idle_timeout=60.0))
    """
    import pyarrow as pa
    from google.api_core import exceptions as gexc

    if not isinstance(offset, int) or isinstance(offset, bool) or not 0 <= offset < 2**63:
        raise DataError(
            f"{source.uri}: row offset {offset!r:.40} is not a row of the stream (a tampered or foreign "
            "data state): start the epoch afresh"
        )
    if time.time() >= source.expires - EXPIRY_MARGIN:
        source = _renewed(source, "has expired")
    schema = pa.ipc.read_schema(pa.py_buffer(source.schema)) if source.schema else None
    pos = offset
    failures = 0
    pauses = _backoff()
    while True:
        try:
            for batch in _read_from(source, pos, schema, idle_timeout):
                if schema is None:
                    schema = batch.schema
                pos += batch.num_rows
                failures = 0
                pauses = _backoff()
                yield pos - batch.num_rows, batch
            if pos == offset > 0:
                _check_end(source, offset, schema, idle_timeout)
            return
        except (gexc.NotFound, gexc.FailedPrecondition) as err:
            if failures:
                raise _stream_error(source, pos, err) from None
            failures += 1
            source = _renewed(source, f"is gone ({type(err).__name__})")
        except gexc.GoogleAPICallError as err:
            failures += 1
            if not transient(err) or failures > RETRIES:
                raise _stream_error(source, pos, err, failures) from None
            logger.warning("%s: stream broke at row %d (%s); retrying from there", source.uri, pos, err)
            time.sleep(max(next(pauses), _retry_delay(err)))


def _check_end(source: StreamSource, offset: int, schema: Any, idle_timeout: float) -> None:
    """Raise a DataError when ``offset`` lies past the end of the stream (a read from it gave no row: the
    stream either ends exactly there, or the offset is out of bounds; a read from ``offset - 1`` tells)."""
    from google.api_core import exceptions as gexc

    try:
        last = sum(batch.num_rows for batch in _read_from(source, offset - 1, schema, idle_timeout))
    except (gexc.InvalidArgument, gexc.OutOfRange):
        last = 0
    except gexc.GoogleAPICallError as err:
        raise _stream_error(source, offset - 1, err) from None
    if not last:
        raise DataError(
            f"{source.uri}: the resume offset {offset} is past the end of stream {source.stream}; the data "
            "state was altered or belongs to another session: start the epoch afresh"
        )


def transient(err: Exception) -> bool:
    """True for the stream errors that Google's guidance retries: ``UNAVAILABLE``, ``RESOURCE_EXHAUSTED``
    (quota, with the server's ``RetryInfo`` delay when it sends one), ``INTERNAL`` (a dropped HTTP/2
    stream, ``RST_STREAM``), ``DEADLINE_EXCEEDED``, ``ABORTED`` and ``UNKNOWN`` (a transport error with no
    status). The others (``UNAUTHENTICATED``, ``PERMISSION_DENIED``, ``CANCELLED``, ``INVALID_ARGUMENT``,
    ``OUT_OF_RANGE``, ...) will not heal by retrying."""
    from google.api_core import exceptions as gexc
    from google.api_core.retry import if_exception_type

    return bool(
        if_exception_type(
            gexc.ServiceUnavailable,
            gexc.ResourceExhausted,
            gexc.InternalServerError,
            gexc.DeadlineExceeded,
            gexc.Aborted,
            gexc.Unknown,
        )(err)
    )


def _backoff() -> Iterator[float]:
    """Seconds to wait before each retry of a broken stream: exponential with jitter (``google.api_core``)."""
    from google.api_core.retry import exponential_sleep_generator

    return exponential_sleep_generator(initial=0.2, maximum=30.0, multiplier=2.0)


def _retry_delay(err: BaseException) -> float:
    """The delay a ``RESOURCE_EXHAUSTED`` status asks for in its ``RetryInfo`` detail (at most 60 s), or 0."""
    for detail in getattr(err, "details", None) or ():
        delay = getattr(detail, "retry_delay", None)
        if delay is not None and hasattr(delay, "seconds"):
            return min(60.0, float(delay.seconds) + float(getattr(delay, "nanos", 0)) / 1e9)
    return 0.0


_FIXES = {
    "UNAUTHENTICATED": "the job's credentials were refused: check the service account or run "
    "`gcloud auth application-default login`",
    "PERMISSION_DENIED": "grant the job's service account roles/bigquery.readSessionUser on the project and "
    "roles/bigquery.dataViewer on the table",
    "CANCELLED": "the read was cancelled (by the server or a shutdown): resume from the last checkpoint",
    "INVALID_ARGUMENT": "the stream or its row offset is not valid (a data state of another table or "
    "session?): start the epoch afresh",
    "OUT_OF_RANGE": "the row offset is past the stream's end: start the epoch afresh",
    "NOT_FOUND": "the read session is gone, also in a new session: start the epoch afresh",
    "FAILED_PRECONDITION": "the read session is gone, also in a new session: start the epoch afresh",
}


def _stream_error(source: StreamSource, pos: int, err: Any, failures: int = 1) -> DataError:
    """The typed error of a stream that failed for good: names the table, stream, row and code."""
    code = getattr(getattr(err, "grpc_status_code", None), "name", None) or type(err).__name__
    times = f" {failures} times" if failures > 1 else ""
    fix = _FIXES.get(code, "check the network and the BigQuery quota, then resume from the last checkpoint")
    return DataError(
        f"{source.uri}: reading stream {source.stream} from row {pos} failed{times} ({code}: "
        f"{getattr(err, 'message', err)}); {fix}"
    )


def _read_from(source: StreamSource, offset: int, schema: Any, idle_timeout: float) -> Iterator[Any]:
    """Record batches from ``offset``; skips rows locally when the server did not honour the offset.

    Raises ``DeadlineExceeded`` (retried by :func:`read_stream`) when the server sends nothing for
    ``idle_timeout`` seconds while this reader waits for a message.
    """
    from google.api_core import exceptions as gexc

    responses = read_client().read_rows(read_stream=source.stream, offset=offset, timeout=CALL_TIMEOUT)
    watch = _IdleWatch(responses, idle_timeout)
    try:
        yield from _batches(source, offset, schema, watch)
    except gexc.GoogleAPICallError:
        if watch.fired:
            raise gexc.DeadlineExceeded(
                f"no message for {idle_timeout:g} s; the stream was cancelled (idle timeout)"
            ) from None
        raise
    finally:
        watch.close()
        getattr(responses, "cancel", lambda: None)()  # a stream left open holds a server thread


class _IdleWatch:
    """Iterates ``responses``; a watchdog thread cancels the call when one wait for the next message lasts
    ``timeout`` seconds (time the consumer spends between messages does not count)."""

    def __init__(self, responses: Any, timeout: float):
        import threading

        self.responses = responses
        self.timeout = timeout
        self.fired = False
        self._since: float | None = None  # when the current wait for a message began
        self._wake = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._watch, name="vertexrt-bq-idle", daemon=True)
        self._thread.start()

    def __iter__(self) -> Iterator[Any]:
        it = iter(self.responses)
        while True:
            with self._wake:
                self._since = time.monotonic()
                self._wake.notify()
            try:
                message = next(it)
            except StopIteration:
                return
            finally:
                with self._wake:
                    self._since = None
            yield message

    def _watch(self) -> None:
        with self._wake:
            while not self._closed:
                if self._since is None:
                    self._wake.wait()
                    continue
                left = self._since + self.timeout - time.monotonic()
                if left > 0:
                    self._wake.wait(left)
                    continue
                self.fired = self._closed = True
        if self.fired:
            getattr(self.responses, "cancel", lambda: None)()

    def close(self) -> None:
        with self._wake:
            self._closed = True
            self._wake.notify()


def _batches(source: StreamSource, offset: int, schema: Any, responses: Any) -> Iterator[Any]:
    import pyarrow as pa

    skip = None
    for response in responses:
        if skip is None:
            progress = response.stats.progress
            ignored = offset > 0 and progress.at_response_start == 0.0 and progress.at_response_end > 0.0
            skip = offset if ignored else 0
        if schema is None and response.arrow_schema.serialized_schema:
            schema = pa.ipc.read_schema(pa.py_buffer(response.arrow_schema.serialized_schema))
        if not response.row_count:
            continue
        batch = pa.ipc.read_record_batch(
            pa.py_buffer(response.arrow_record_batch.serialized_record_batch), schema
        )
        if skip:
            dropped = min(skip, batch.num_rows)
            skip -= dropped
            batch = batch.slice(dropped)
            if not batch.num_rows:
                continue
        yield batch
    if skip:
        raise DataError(
            f"{source.uri}: the stream ended {skip} rows before the resume offset {offset}; the table or "
            "the session's split changed since the checkpoint: restart the epoch"
        )

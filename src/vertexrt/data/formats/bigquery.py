"""BigQuery tables: the Storage Read API when available, ``list_rows`` paging over row ranges as fallback.

:meth:`BigQuery.plan` routes a table: one Storage Read session shared by every rank (see
:mod:`vertexrt.data.bigquery_storage`), whose streams become the dataset's sources (a reader's position is
a row offset in its stream); ``None`` when the API is not enabled or cannot be shared, and then the table
is read with ``list_rows`` as below. A data state keeps the session: a restart reads the same streams while it
lives (exact resume), and at an epoch start a session with under an hour left is replaced once, by the chief
(:meth:`BigQuery.renew`), before DataLoader workers start.

Each reader reads its own contiguous row range with ``tabledata.list`` (``start_index``), so the position
of a reader is a row index and resume is exact as long as the table is not modified. The client comes
from :func:`vertexrt.clients.bigquery_client` (project resolver; ``BIGQUERY_EMULATOR_HOST`` for local
servers) and is created once per process.

Example:
    >>> ds = vertexrt.data.open_dataset("bq://my-project.my_dataset.training")
"""

from __future__ import annotations

import itertools
import logging
import os
import time
from collections.abc import Iterator, Sequence
from typing import Any

from vertexrt.data.bigquery_storage import StreamSource, read_stream
from vertexrt.data.formats.base import Errors, Format
from vertexrt.data.sources import TableSource
from vertexrt.errors import DataError

logger = logging.getLogger(__name__)
_CLIENTS: dict[tuple[int, str | None, str | None], Any] = {}


def client(project: str | None = None) -> Any:
    """This process's BigQuery client (clients are not shared across fork), per project and endpoint."""
    key = (os.getpid(), project, os.environ.get("BIGQUERY_EMULATOR_HOST"))
    if key not in _CLIENTS:
        from vertexrt.clients import bigquery_client

        _CLIENTS[key] = bigquery_client(project)
    return _CLIENTS[key]


class BigQuery(Format):
    """Rows of a BigQuery table as dicts.

    Args:
        columns: the columns to read (default all).
        page_size: rows per ``tabledata.list`` page.
        project: the project that runs (and is billed for) the reads; default the resolved job project.
        timeout: seconds before an unreachable or failing BigQuery API call gives up (retries included),
            and the longest wait for the next message of a Storage Read stream before it is reopened.
        row_filter: a Storage Read ``row_restriction`` (``"label > 0 AND split = 'train'"``).
        streams: read-session streams per replica (the session asks for ``streams * world_size``, and at
            least one per reader: replicas x DataLoader workers). With ``equalize``, or when the server
            grants fewer streams than readers, the streams' rows are counted once and each reader reads a
            contiguous row range of them (from its first row), so every reader reads about its share.
        storage_api: read through the BigQuery Storage Read API (billed per byte read; ~50x the rows/s of
            ``list_rows``), falling back to ``list_rows`` where it is not enabled; False: always ``list_rows``
            (``tabledata.list``, no Storage Read charge).
    """

    name = "bigquery"

    def __init__(
        self,
        columns: Sequence[str] | None = None,
        page_size: int = 10_000,
        project: str | None = None,
        timeout: float = 120.0,
        row_filter: str | None = None,
        streams: int = 8,
        storage_api: bool = True,
    ):
        self.columns = list(columns) if columns is not None else None
        self.page_size = page_size
        self.project = project
        self.timeout = timeout
        self.row_filter = row_filter
        self.streams = streams
        self.storage_api = storage_api

    def plan(
        self,
        source: TableSource,
        rank: int,
        world_size: int,
        resume: dict[str, Any] | None = None,
        readers: int | None = None,
    ) -> list[StreamSource] | None:
        """The Storage Read streams every rank reads (the chief creates the session, or reuses the session
        ``resume`` of a saved state while it lives), or None: use list_rows (``storage_api=False``, the API
        not enabled, or several ranks without a torch.distributed group). A new session asks for
        ``streams * world_size`` streams, and at least one per reader (``readers``: replicas x DataLoader
        workers).

        Call it in the main process of every rank at the same point (it may broadcast);
        :meth:`~vertexrt.data.dataset.Dataset.prepare` does. With several ranks, every rank must open the
        same table, columns and row filter: else every rank raises the same DataError naming two of them.

        Example:
            >>> streams = BigQuery(columns=["x"]).plan(parse_table("bq://p.d.t"), rank=0, world_size=1)
        """
        from vertexrt.data.bigquery_session import agree, read_request, shared_session

        def create() -> list[StreamSource]:
            reused = self.reuse(source, resume) if resume else None
            return reused or self._create(source, world_size, readers)

        request = read_request(source.table_id, self.columns, self.row_filter)
        if self.storage_api:
            streams = shared_session(create, rank, world_size, request)
        else:  # each rank reads its own rows with list_rows, of the same table
            agree(request, rank, world_size)
            streams = None
        if streams is None and self.row_filter:
            why = (
                "which is not available here; enable bigquerystorage.googleapis.com (and, with several "
                "replicas, start torch.distributed first)"
                if self.storage_api
                else "and this format has storage_api=False; drop storage_api=False"
            )
            raise DataError(
                f"bq://{source.table_id}: row_filter={self.row_filter!r} needs the Storage Read API, {why}, "
                "or write the filtered rows to a table"
            )
        return streams

    def reuse(self, source: TableSource, record: dict[str, Any]) -> list[StreamSource] | None:
        """The streams of a saved session (a data state's checked ``session``) while it lives, else None.

        Example:
            >>> fmt.reuse(table, check_record(state["session"])) or fmt.plan(table, rank, world_size)
        """
        from vertexrt.data.bigquery_session import reuse_session

        return reuse_session(source, record, self.columns, self.row_filter, self.project)

    def check_saved(self, source: TableSource, record: dict[str, Any]) -> None:
        """Raise a DataError unless a saved session (a data state's checked ``session``) reads ``source``
        with this format's columns and row filter (names both).

        Example:
            >>> fmt.check_saved(table, check_record(state["session"]))
        """
        from vertexrt.data.bigquery_session import check_saved_request

        check_saved_request(source, record, self.columns, self.row_filter)

    def renew(
        self,
        source: TableSource,
        streams: list[StreamSource],
        rank: int,
        world_size: int,
        mid_epoch: bool,
        readers: int | None = None,
    ) -> list[StreamSource]:
        """``streams``, or a new session's when theirs has less than an hour left and the chief is at an
        epoch start (the chief decides; every rank calls it at the same point, in its main process).

        Example:
            >>> streams = fmt.renew(table, streams, rank, world_size, mid_epoch=False)
        """
        from vertexrt.data.bigquery_session import RENEW_MARGIN, shared_session

        def create() -> list[StreamSource]:
            if mid_epoch or not streams or time.time() < streams[0].expires - RENEW_MARGIN:
                return streams
            fresh = self._create(source, world_size, readers)
            logger.info(
                "bq://%s: read session %s expires within %d s; the next epochs read session %s",
                source.table_id,
                streams[0].session,
                RENEW_MARGIN,
                fresh[0].session if fresh else "(no streams)",
            )
            return fresh

        return shared_session(create, rank, world_size) or streams

    def _create(self, source: TableSource, world_size: int, readers: int | None = None) -> list[StreamSource]:
        from vertexrt.data.bigquery_storage import create_session

        streams = max(self.streams * world_size, readers or 0)
        return create_session(source, streams, self.columns, self.row_filter, self.project, self.timeout)

    def count_streams(self, streams: Sequence[StreamSource], rank: int, world_size: int) -> list[int]:
        """Rows in each stream of a plan, each stream read once across all ranks (every rank calls it).

        Example:
            >>> fmt.count_streams(fmt.plan(table, rank, world_size), rank, world_size)
            [25000, 25000, 50000]
        """
        from vertexrt.data.bigquery_session import shared_counts

        return shared_counts(lambda stream: self.count(stream, Errors()), streams, rank, world_size)

    def _retry(self) -> Any:
        from google.cloud.bigquery.retry import DEFAULT_RETRY

        return DEFAULT_RETRY.with_timeout(self.timeout)

    def _table(self, source: TableSource) -> Any:
        try:
            return client(self.project).get_table(source.table_id, retry=self._retry(), timeout=self.timeout)
        except Exception as err:  # google.api_core exceptions: NotFound, Forbidden, BadRequest
            raise DataError(
                f"bq://{source.table_id}: cannot read the table ({type(err).__name__}: {err}); "
                "check the table name and that the job's service account has bigquery.tables.getData on it"
            ) from None

    def count(self, source: TableSource | StreamSource, errors: Errors) -> int:
        if isinstance(source, StreamSource):
            return sum(batch.num_rows for _, batch in read_stream(source, 0, self.timeout))
        return int(self._table(source).num_rows or 0)

    def read_columns(
        self, source: TableSource | StreamSource, start: int, end: int | None, errors: Errors
    ) -> Iterator[tuple[int, Any]]:
        if not isinstance(source, StreamSource):
            return super().read_columns(source, start, end, errors)
        from vertexrt.data.columns import Columns

        return (
            (pos, Columns.from_arrow(batch))
            for pos, batch in _until(read_stream(source, start, self.timeout), end)
        )

    def read(
        self, source: TableSource | StreamSource, start: int, end: int | None, errors: Errors
    ) -> Iterator[tuple[int, list[dict[str, Any]]]]:
        if isinstance(source, StreamSource):
            for pos, batch in _until(read_stream(source, start, self.timeout), end):
                for i in range(0, batch.num_rows, 256):  # small slices: see the list_rows loop below
                    yield pos + i, batch.slice(i, 256).to_pylist()
            return
        table = self._table(source)
        stop = int(table.num_rows or 0) if end is None else end
        if start >= stop:
            return
        fields = None
        if self.columns is not None:
            fields = [f for f in table.schema if f.name in self.columns]
        rows = client(self.project).list_rows(
            table,
            selected_fields=fields,
            start_index=start,
            max_results=stop - start,
            page_size=self.page_size,
            retry=self._retry(),
            timeout=self.timeout,
        )
        pos = start
        try:
            for page in rows.pages:
                page_rows = iter(page)
                # Converted a slice at a time: dicts holding lists are GC-tracked, and a whole page of
                # them alive at once makes the cyclic collector crawl.
                while batch := [dict(row.items()) for row in itertools.islice(page_rows, 256)]:
                    yield pos, batch
                    pos += len(batch)
        except Exception as err:
            raise DataError(
                f"bq://{source.table_id}: reading rows from {pos} failed ({type(err).__name__}: {err})"
            ) from None


def _until(batches: Iterator[tuple[int, Any]], end: int | None) -> Iterator[tuple[int, Any]]:
    """Record batches cut at row ``end`` of the stream (None: to the end)."""
    for pos, batch in batches:
        if end is not None and pos + batch.num_rows >= end:
            if end > pos:
                yield pos, batch.slice(0, end - pos)
            return
        yield pos, batch

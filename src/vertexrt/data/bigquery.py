"""BigQuery tables: ``list_rows`` paging over row ranges (one range per reader); rows as dicts.

Each reader reads its own contiguous row range with ``tabledata.list`` (``start_index``), so the position
of a reader is a row index and resume is exact as long as the table is not modified. The client comes from
:func:`vertexrt.env.bigquery_client` (project resolver; ``BIGQUERY_EMULATOR_HOST`` for local servers) and is
created once per process.

Example:
    >>> ds = vertexrt.data.open_dataset("bq://my-project.my_dataset.training")
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Iterator, Sequence
from typing import Any

from vertexrt.data.formats import Errors, Format
from vertexrt.data.sources import TableSource
from vertexrt.errors import DataError

_CLIENTS: dict[tuple[int, str | None, str | None], Any] = {}


def client(project: str | None = None) -> Any:
    """This process's BigQuery client (clients are not shared across fork), per project and endpoint."""
    key = (os.getpid(), project, os.environ.get("BIGQUERY_EMULATOR_HOST"))
    if key not in _CLIENTS:
        from vertexrt.env import bigquery_client

        _CLIENTS[key] = bigquery_client(project)
    return _CLIENTS[key]


class BigQuery(Format):
    """Rows of a BigQuery table as dicts.

    Args:
        columns: the columns to read (default all).
        page_size: rows per ``tabledata.list`` page.
        project: the project that runs (and is billed for) the reads; default the resolved job project.
        timeout: seconds before an unreachable or failing BigQuery API call gives up (retries included).
    """

    name = "bigquery"

    def __init__(
        self,
        columns: Sequence[str] | None = None,
        page_size: int = 10_000,
        project: str | None = None,
        timeout: float = 120.0,
    ):
        self.columns = list(columns) if columns is not None else None
        self.page_size = page_size
        self.project = project
        self.timeout = timeout

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

    def count(self, source: TableSource, errors: Errors) -> int:
        return int(self._table(source).num_rows or 0)

    def read(
        self, source: TableSource, start: int, end: int | None, errors: Errors
    ) -> Iterator[tuple[int, list[dict[str, Any]]]]:
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

"""A ``bq://`` dataset's read session: its Storage Read streams (planned once per process, by the chief,
shared with every rank), their row counts, the renewal of a session about to expire, and the record a
data state keeps of it to read the same streams on resume.

A table read with ``list_rows`` (no Storage Read API) has no streams: its units are row ranges of the
table's rows, counted from its metadata.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from vertexrt.data.formats.base import Errors, Format
from vertexrt.data.planning import Intervals, PlanContext, counted
from vertexrt.data.sharding import Unit
from vertexrt.data.sources import TableSource
from vertexrt.errors import ConfigError

if TYPE_CHECKING:
    from vertexrt.data.bigquery_storage import StreamSource


@runtime_checkable
class TableReader(Protocol):
    """A table format that reads through Storage Read sessions (:class:`~vertexrt.data.formats.bigquery.
    BigQuery`)."""

    row_filter: str | None

    def plan(
        self,
        source: TableSource,
        rank: int,
        world_size: int,
        resume: dict[str, Any] | None = None,
        readers: int | None = None,
    ) -> list[StreamSource] | None: ...

    def reuse(self, source: TableSource, record: dict[str, Any]) -> list[StreamSource] | None: ...

    def check_saved(self, source: TableSource, record: dict[str, Any]) -> None: ...

    def renew(
        self,
        source: TableSource,
        streams: list[StreamSource],
        rank: int,
        world_size: int,
        mid_epoch: bool,
        readers: int | None = None,
    ) -> list[StreamSource]: ...

    def count_streams(self, streams: Sequence[StreamSource], rank: int, world_size: int) -> list[int]: ...


class TableSession:
    """The units of a BigQuery table (see the module docstring): a
    :class:`~vertexrt.data.planning.UnitSource`."""

    elastic = False

    def __init__(self, table: TableSource, fmt: Format, errors: Errors):
        self.table = table
        self.format = fmt
        self.reader = fmt if isinstance(fmt, TableReader) else None  # None: list_rows row ranges only
        self.errors = errors
        self.planned = False  # planned in this process (streams may still be None: list_rows)
        self.streams: list[StreamSource] | None = None
        self.stream_rows: dict[int, int] = {}  # rows per stream index, once counted
        self.saved: dict[str, Any] | None = None  # the read session of a loaded state, until planned
        self.checked_epoch: int | None = None  # the epoch whose start last checked the session's expiry
        self.rows: int | None = None  # the table's rows from its metadata

    # -- the read session ---------------------------------------------------------------------------
    def current(self, context: PlanContext) -> list[StreamSource] | None:
        """The table's Storage Read streams (planned once per process: it may broadcast), or None: a table
        read with ``list_rows`` row ranges. In a rank's main process, the first call in a new epoch replaces
        a session about to expire (:meth:`renew`; it broadcasts)."""
        if self.reader is None:
            return None
        if not self.planned:
            if context.in_loader_worker:  # each worker would make its own session: plan in the rank's process
                raise ConfigError(
                    f"bq://{self.table.table_id}: the read session is planned in each rank's main process "
                    "before DataLoader workers start: call ds.prepare() there (as_torch() and "
                    "vertexrt.data.torch.DataLoader do)"
                )
            topo = context.topology
            saved = self.saved if context.mid_epoch else None
            streams = self.reader.plan(
                self.table, topo.rank, topo.world_size, resume=saved, readers=context.readers
            )
            self.planned, self.streams = True, streams
            self.checked_epoch = context.epoch
            if streams and saved and streams[0].session == saved["name"]:
                self.stream_rows.update(enumerate(saved["counts"] or []))  # counted when it was saved
            elif streams and context.mid_epoch:
                from vertexrt.data.bigquery_session import log_new_session

                log_new_session(self.table.table_id, saved, streams[0].session)
        elif (
            self.checked_epoch != context.epoch and self.streams is not None and not context.in_loader_worker
        ):
            self.renew(context)
        return self.streams

    def renew(self, context: PlanContext) -> None:
        """Replace the planned session by a new one if it has less than an hour left and the chief is at
        an epoch start (every rank calls it at the same point: the chief decides and broadcasts), so
        DataLoader workers never meet an expired session and make sessions of their own."""
        streams = self.streams
        self.checked_epoch = context.epoch
        if not streams or self.reader is None:
            return
        topo = context.topology
        fresh = self.reader.renew(
            self.table,
            streams,
            topo.rank,
            topo.world_size,
            mid_epoch=context.mid_epoch,
            readers=context.readers,
        )
        if fresh and fresh[0].session != streams[0].session:
            self.streams = fresh
            self.stream_rows = {}
            if self.contiguous(context, None, context.readers):
                self._count_streams(context)  # every rank is here: count the new streams together

    def prepare(self, context: PlanContext) -> None:
        """Plan the streams (or renew a planned session about to expire) in a rank's main process."""
        if self.planned and self.streams is not None:
            self.renew(context)
        self.current(context)

    def new_epoch(self, context: PlanContext) -> None:
        if self.planned:
            self.current(context)

    def _count_streams(self, context: PlanContext) -> None:
        """Every stream's rows, counted once across the ranks (every rank calls it); a DataLoader worker not
        prepared for (as_torch() without num_workers) counts alone: a collective from a worker would wait for
        ranks that never join it."""
        assert self.reader is not None and self.streams is not None  # noqa: S101 - callers checked
        topo = context.topology
        rank, world = (0, 1) if context.in_loader_worker else (topo.rank, topo.world_size)
        self.stream_rows.update(enumerate(self.reader.count_streams(self.streams, rank, world)))

    # -- units (the planning.UnitSource protocol) ---------------------------------------------------
    def units(self, context: PlanContext, readers: int) -> list[Unit]:
        streams = self.current(context)
        if streams is not None:
            return [Unit(i) for i in range(len(streams))]
        rows = self.table_rows()
        parts = max(1, readers)
        return [Unit(0, rows * i // parts, rows * (i + 1) // parts) for i in range(parts)]

    def cut(self, order: list[Unit], readers: int) -> list[Unit]:
        return order

    def counts(self, units: Sequence[Unit], context: PlanContext, shared: bool) -> list[int]:
        streams = self.current(context) or []
        if shared and streams and any(u.source not in self.stream_rows for u in units):
            self._count_streams(context)
        out = []
        for unit in units:
            if unit.end is not None:  # rows [start, end) of the table
                out.append(unit.end - unit.start)
            else:
                if unit.source not in self.stream_rows:
                    self.stream_rows[unit.source] = self.format.count(streams[unit.source], self.errors)
                out.append(self.stream_rows[unit.source])
        return out

    def total(self, context: PlanContext) -> int:
        """The table's rows from its metadata; with a ``row_filter`` its streams' rows, counted together
        (every rank calls it at the same point)."""
        if self.reader is None or not self.reader.row_filter:
            return self.table_rows()
        return sum(counted(self, self.units(context, 1), context))

    def table_rows(self) -> int:
        """The table's rows from its metadata."""
        if self.rows is None:
            self.rows = self.format.count(self.table, self.errors)
        return self.rows

    def contiguous(self, context: PlanContext, unread: Intervals | None, readers: int) -> bool:
        """Storage Read streams (a reader starts at an exact row) with ``equalize`` or fewer streams than
        readers."""
        streams = self.current(context)
        return bool(streams) and (context.equalizing or len(streams or ()) < readers)

    def reading(self, units: list[Unit]) -> list[Unit]:
        # a stream's rows [a, b): read from row a, stop at b
        return [Unit(u.source, 0, (u.end or 0) - u.start, True, u.start, u.end) for u in units]

    def read_sources(self, context: PlanContext) -> Sequence[Any]:
        streams = self.current(context)
        return [self.table] if streams is None else streams

    def identity(self) -> Any:
        return self.table.table_id

    def summary(self) -> tuple[str, str | None]:
        return self.table.table_id, None

    def names(self) -> list[str]:
        return [self.table.table_id]

    def uris(self) -> list[str]:
        return []

    def title(self) -> str:
        return self.table.table_id

    # -- the record in a data state -----------------------------------------------------------------
    def plan_record(self) -> dict[str, Any] | None:
        """The planned session, to read the same streams elsewhere (with their row counts when all are
        known), or None before planning."""
        if not self.streams:
            return None
        from vertexrt.data.bigquery_session import session_record

        counts = [self.stream_rows.get(i) for i in range(len(self.streams))]
        known = None if None in counts else [n for n in counts if n is not None]
        return session_record(self.streams, known)

    def state_fields(self) -> dict[str, Any]:
        """The ``session`` of a data state: the planned session, else the one loaded."""
        if self.streams:
            return {"session": self.plan_record()}
        return {"session": self.saved and json.loads(json.dumps(self.saved))}

    def checked(self, state: dict[str, Any]) -> dict[str, Any] | None:
        """A state's saved ``session``, checked (it must read this table with these columns and filter)."""
        from vertexrt.data.bigquery_session import check_record

        session = check_record(state.get("session"))
        if session and self.reader is not None:  # one of another table, columns or filter is a DataError
            self.reader.check_saved(self.table, session)
        return session

    def load(self, session: dict[str, Any] | None, epoch: int, mid_epoch: bool, equalizing: bool) -> None:
        """The next plan reads the saved session's streams again while it lives (exact resume). A plan
        made before (a DataLoader plans when it is made) is replaced here, without a broadcast (each rank
        holds the same saved session) and with the saved counts, so that DataLoader workers that start next
        read the saved streams and count nothing."""
        self.saved = session
        self.checked_epoch = epoch
        planned = self.streams
        if not (mid_epoch and planned and (session is None or planned[0].session != session["name"])):
            return
        reused = self.reader.reuse(self.table, session) if session and self.reader is not None else None
        if reused and session and (session["counts"] or not equalizing):
            self.streams = reused
            self.stream_rows = dict(enumerate(session["counts"] or []))
        else:
            from vertexrt.data.bigquery_session import log_new_session

            log_new_session(self.table.table_id, session, planned[0].session)

    def follow(self, record: dict[str, Any] | None) -> None:
        """Read the streams (and their row counts) of ``record`` (a :meth:`plan_record` made elsewhere: the
        session a DataLoader's parent renewed) while it lives."""
        streams = self.reader.reuse(self.table, record) if record and self.reader is not None else None
        if streams and record:
            self.streams = streams
            self.stream_rows = dict(enumerate(record["counts"] or []))

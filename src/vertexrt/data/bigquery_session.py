"""A BigQuery read session shared by the ranks and kept in a data state.

The chief creates the session (``vertexrt.data.bigquery_storage.create_session``) and every rank gets its
streams (:func:`shared_session`), after the ranks agree that they all ask for the same read (:func:`agree`);
the rows of each stream are counted once in all (:func:`shared_counts`). A dataset's state records its
session (:func:`session_record`): a restart while the session lives reads the same streams again
(:func:`reuse_session`), so resume stays exact on real BigQuery, which does not promise the same split of a
table into streams in a new session. A record loaded from a state is untrusted until :func:`check_record`.

Example:
    >>> streams = shared_session(lambda: create_session(table, 8), rank, world_size, request)
    >>> state["session"] = session_record(streams, counts)
    >>> reuse_session(table, check_record(state["session"])) or create_session(table, 8)
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Sequence
from typing import Any

from vertexrt.data.bigquery_storage import EXPIRY_MARGIN, StorageUnavailable, StreamSource
from vertexrt.data.sources import TableSource
from vertexrt.errors import DataError

logger = logging.getLogger(__name__)

RENEW_MARGIN = 3600.0
"""At an epoch start, a session with less than this left is replaced (once per job, by the chief)."""
MAX_SAVED_STREAMS = 10_000


def session_record(
    streams: Sequence[StreamSource], counts: Sequence[int] | None = None
) -> dict[str, Any] | None:
    """What a data state keeps of a plan to read the same streams again: session, what it reads (table,
    columns, row filter: :func:`read_request`), stream names, expiry, and the rows of each stream when they
    were counted (for ``equalize``).

    Example:
        >>> session_record(streams, [50000, 50000])
        {'name': 'projects/p/locations/US/sessions/ab12', 'table': 'p.d.t', 'columns': None,
         'row_filter': None, 'expires': 1767225600.0, 'streams': ['0', '1'], 'counts': [50000, 50000]}
    """
    if not streams:
        return None
    session = streams[0].session
    prefix = f"{session}/streams/"
    record = {
        "name": session,
        **read_request(streams[0].table_id, streams[0].columns, streams[0].row_filter),
        "expires": streams[0].expires,
        "streams": [s.stream[len(prefix) :] if s.stream.startswith(prefix) else s.stream for s in streams],
    }
    if counts is not None:
        record["counts"] = list(counts)
    return record


def check_record(record: Any) -> dict[str, Any] | None:
    """``record`` (a data state's ``session``, untrusted) validated, or None when there is none.

    Raises:
        DataError: it is not a :func:`session_record` (names the key).
    """
    if record is None:
        return None
    where = "the data state's 'session'"
    if not isinstance(record, dict):
        raise DataError(f"{where} is {type(record).__name__}, not a mapping: save the state again")
    name, expires, streams = record.get("name"), record.get("expires"), record.get("streams")
    if not isinstance(name, str) or not 0 < len(name) <= 1024:
        raise DataError(f"{where}: 'name' must be a session name of 1 to 1024 characters, not {name!r:.80}")
    if not isinstance(expires, int | float) or isinstance(expires, bool) or not math.isfinite(expires):
        raise DataError(f"{where}: 'expires' must be seconds since the epoch, not {expires!r:.80}")
    if (
        not isinstance(streams, list)
        or not 0 < len(streams) <= MAX_SAVED_STREAMS
        or not all(isinstance(n, str) and 0 < len(n) <= 1024 for n in streams)
        or any("/" in n and not n.startswith(f"{name}/") for n in streams)
    ):
        raise DataError(
            f"{where}: 'streams' must be a list of 1 to {MAX_SAVED_STREAMS} stream names of session "
            f"{name!r:.80}, not {streams!r:.80}; save the state again"
        )
    counts = record.get("counts")
    if counts is not None and (
        not isinstance(counts, list)
        or len(counts) != len(streams)
        or not all(isinstance(n, int) and not isinstance(n, bool) and 0 <= n < 2**63 for n in counts)
    ):
        raise DataError(
            f"{where}: 'counts' must be the rows of each of its {len(streams)} streams, not {counts!r:.80}; "
            "save the state again"
        )
    request = {key: record.get(key) for key in ("table", "columns", "row_filter")}
    table, columns, row_filter = request.values()
    if (
        not (table is None or isinstance(table, str) and 0 < len(table) <= 1024)
        or not (
            columns is None
            or isinstance(columns, list)
            and len(columns) <= 100_000
            and all(isinstance(c, str) and len(c) <= 1024 for c in columns)
        )
        or not (row_filter is None or isinstance(row_filter, str) and len(row_filter) <= 1_000_000)
    ):
        raise DataError(
            f"{where}: 'table', 'columns' and 'row_filter' must be what the session reads (a table id, a "
            f"list of column names or null, a filter or null), not {request!r:.120}; save the state again"
        )
    return {"name": name, **request, "expires": float(expires), "streams": list(streams), "counts": counts}


def read_request(table_id: str, columns: Sequence[str] | None, row_filter: str | None) -> dict[str, Any]:
    """What a read session reads, as a data state keeps it and as ranks compare it.

    Example:
        >>> read_request("p.d.t", ("x",), "x > 0")
        {'table': 'p.d.t', 'columns': ['x'], 'row_filter': 'x > 0'}
    """
    return {
        "table": table_id,
        "columns": list(columns) if columns is not None else None,
        "row_filter": row_filter or None,
    }


def describe(request: dict[str, Any]) -> str:
    """``request`` (:func:`read_request`) as the words of an error message."""
    columns = "all columns" if request["columns"] is None else f"columns {request['columns']!r:.300}"
    where = f", row_filter={request['row_filter']!r:.300}" if request["row_filter"] else ", no row_filter"
    return f"bq://{request['table']} ({columns}{where})"


def check_saved_request(
    table: TableSource, record: dict[str, Any], columns: Sequence[str] | None, row_filter: str | None
) -> bool:
    """True when a saved session (``record`` from :func:`check_record`) reads what this dataset reads; False
    when the record does not say (saved by an older vertexrt: its session is not reused).

    Raises:
        DataError: it reads another table, other columns or another filter (names both).
    """
    if record.get("table") is None:
        return False
    saved = {key: record.get(key) for key in ("table", "columns", "row_filter")}
    mine = read_request(table.table_id, columns, row_filter)
    if saved != mine:
        raise DataError(
            f"the data state's read session {record['name']!r:.120} reads {describe(saved)}, and this "
            f"dataset reads {describe(mine)}: load the state saved for this table, columns and row_filter, "
            "or leave the state out to start the epoch afresh"
        )
    return True


def reuse_session(
    table: TableSource,
    record: dict[str, Any],
    columns: Sequence[str] | None = None,
    row_filter: str | None = None,
    project: str | None = None,
) -> list[StreamSource] | None:
    """The streams of a saved session (``record`` from :func:`check_record`) while it lives, else None.
    A session that reads another table, other columns or another filter is a DataError naming both.

    The schema comes with each stream's first ``ReadRows`` message. Example:
        >>> reuse_session(parse_table("bq://p.d.t"), state["session"]) or create_session(...)
    """
    if not check_saved_request(table, record, columns, row_filter):
        return None
    if time.time() >= record["expires"] - EXPIRY_MARGIN:
        return None
    session, names = record["name"], record["streams"]
    return [
        StreamSource(
            table_id=table.table_id,
            session=session,
            stream=name if "/" in name else f"{session}/streams/{name}",
            index=i,
            streams=len(names),
            expires=record["expires"],
            schema=b"",
            columns=tuple(columns) if columns is not None else None,
            row_filter=row_filter,
            project=project,
        )
        for i, name in enumerate(names)
    ]


def log_new_session(table_id: str, saved: dict[str, Any] | None, session: str) -> None:
    """The loud warning of a mid-epoch resume that cannot read its saved session (expired, or not saved)."""
    logger.warning(
        "bq://%s: the read session of the loaded mid-epoch position (%s) %s; it continues in new session %s "
        "at the same stream and row: rows of this epoch may repeat or be missed (BigQuery may split the "
        "table into other streams)",
        table_id,
        saved["name"] if saved else "not saved",
        "is not in the state"
        if not saved
        else "does not name its table (saved by an older vertexrt)"
        if saved.get("table") is None
        else "has expired",
        session,
    )


def shared_session(
    create: Any, rank: int, world_size: int, request: dict[str, Any] | None = None
) -> list[StreamSource] | None:
    """The session every rank reads: ``create()`` on the chief, broadcast over ``torch.distributed``.

    Returns None when the API is unavailable, or when ``world_size > 1`` and no process group is up
    (sessions cannot be shared without one: each rank would get different streams); the caller then
    reads with ``list_rows``. The chief's errors are raised on every rank. With ``request``
    (:func:`read_request`: what this rank asks to read), the ranks first agree that they all ask for the
    same; else every rank raises the same DataError naming the chief's request and the first other one.
    """
    if world_size == 1:
        try:
            return list(create())
        except StorageUnavailable as err:
            logger.info("%s; reading with list_rows", err)
            return None
    if not torch_group_up():
        logger.info("no torch.distributed process group: %d ranks read BigQuery with list_rows", world_size)
        return None
    import torch.distributed as dist

    if request is not None:
        agree(request, rank, world_size)
    box: list[Any] = [None]
    if rank == 0:
        try:
            box[0] = list(create())
        except StorageUnavailable as err:
            box[0] = ("unavailable", str(err))
        except DataError as err:
            box[0] = ("error", str(err))
    dist.broadcast_object_list(box, src=0)
    value = box[0]
    if isinstance(value, tuple):
        if value[0] == "error":
            raise DataError(value[1])
        logger.info("%s; reading with list_rows", value[1])
        return None
    return list(value)


def agree(request: dict[str, Any], rank: int, world_size: int) -> None:
    """Raise the same DataError on every rank unless every rank's ``request`` (:func:`read_request`) is the
    chief's (every rank calls it; a no-op for one rank or without a torch.distributed group; O(1) bytes
    per rank: the chief's request is broadcast, the first rank that differs is found by a MIN all-reduce
    and its request broadcast)."""
    if world_size == 1 or not torch_group_up():
        return
    import torch
    import torch.distributed as dist

    box: list[Any] = [request if rank == 0 else None]
    dist.broadcast_object_list(box, src=0)
    chief = box[0]
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else "cpu"
    first = torch.tensor([world_size if request == chief else rank], dtype=torch.int64, device=device)
    dist.all_reduce(first, op=dist.ReduceOp.MIN)
    other = int(first.item())
    if other == world_size:
        return
    box = [request if rank == other else None]
    dist.broadcast_object_list(box, src=other)
    raise DataError(
        f"the ranks open different BigQuery reads: rank 0 reads {describe(chief)} and rank {other} reads "
        f"{describe(box[0])}; every rank must open the same table with the same columns and row_filter "
        "(they share one read session)"
    )


def shared_counts(count: Any, streams: Sequence[StreamSource], rank: int, world_size: int) -> list[int]:
    """Rows in each of ``streams``, ``count(stream)`` run once per stream in all: rank ``r`` counts streams
    ``r, r + world_size, ...`` and the counts are gathered over ``torch.distributed`` (every rank calls it);
    one rank, or no process group, counts them all.

    Raises:
        DataError: a count failed on any rank: every rank raises the same error, naming the stream and
            the rank (no rank is left waiting in the gather).
    """
    if world_size == 1 or not torch_group_up():
        return [count(stream) for stream in streams]
    import torch.distributed as dist

    mine: dict[int, int] = {}
    failure = None
    for i, stream in enumerate(streams):
        if i % world_size != rank:
            continue
        try:
            mine[i] = count(stream)
        except Exception as err:  # noqa: BLE001 - every rank must reach the gather to learn of it
            why = str(err).removeprefix(f"{stream.uri}: ")
            failure = f"{stream.uri}: counting its rows (to share them out) failed on rank {rank}: {why}"
            break
    parts: list[Any] = [None] * world_size
    dist.all_gather_object(parts, (failure, mine))
    for failed, _ in parts:
        if failed:
            raise DataError(f"{failed}; fix the cause, then restart every rank")
    counts = {i: n for _, part in parts for i, n in part.items()}
    return [counts[i] for i in range(len(streams))]


def torch_group_up() -> bool:
    import sys

    dist = sys.modules.get("torch.distributed")
    return bool(dist is not None and dist.is_available() and dist.is_initialized())

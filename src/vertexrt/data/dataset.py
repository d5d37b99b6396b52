"""The dataset object: iteration, epochs, exact-resume state, and the framework adapters.

Example:
    >>> ds = open_dataset("gs://my-bucket/export/training-*.jsonl", shuffle=True, seed=1)
    >>> ds.set_epoch(0)
    >>> for record in ds: ...
    >>> state = ds.state_dict()         # small JSON; put it in the checkpoint
    >>> ds.load_state_dict(state)       # in a fresh process: continues with the next unseen record
"""

from __future__ import annotations

import atexit
import contextlib
import hashlib
import json
import logging
from collections import deque
from collections.abc import Callable, Generator, Iterator, Sequence
from functools import partial
from itertools import chain
from typing import TYPE_CHECKING, Any, Literal

from vertexrt import audit
from vertexrt.data.columns import Columns, concat, same_schema
from vertexrt.data.cursor import (
    MAX_COUNT,
    OWN,
    Chunk,
    Cursor,
    StreamSpec,
    check_against,
    check_count,
    chunks,
    state_problem,
)
from vertexrt.data.digest import Tally
from vertexrt.data.formats.base import Errors, FileSource, Format, OnError
from vertexrt.data.formats.registry import format_for_uri, format_named
from vertexrt.data.prefetch import Prefetcher
from vertexrt.data.sharding import (
    Topology,
    Unit,
    assign,
    balanced,
    dataloader_worker,
    epoch_order,
    equalized,
    pieces,
    reader_counts,
    remaining,
    replica,
    share,
)
from vertexrt.data.sources import TableSource, expand_files, is_bigquery, parse_table
from vertexrt.errors import ConfigError, DataError
from vertexrt.phases import long_phase

if TYPE_CHECKING:
    import tensorflow as tf

    from vertexrt.data.torch import TorchIterable

logger = logging.getLogger(__name__)

STATE_VERSION = 1
DECODE_RUN = 32
"""Records decoded per run, before the first is handed out. Few: a run's records (their dicts and lists)
stay below the garbage collector's young-generation threshold (700 objects), so decoding triggers no
collections (which walk the whole heap of a process with a framework in it from time to time)."""
Equalize = Literal["auto", "drop_remainder", "pad", "off"]


class Dataset:
    """A sharded, shuffled, resumable stream of records; build it with :func:`open_dataset`.

    Iterating yields the rest of the current epoch for this process's reader; when the epoch is
    exhausted the dataset moves to the next one (``set_epoch`` also selects it explicitly).
    """

    def __init__(
        self,
        sources: Sequence[FileSource] | TableSource,
        fmt: Format,
        *,
        shuffle: bool = True,
        seed: int = 0,
        shuffle_buffer: int = 10_000,
        rank: int | None = None,
        world_size: int | None = None,
        equalize: Equalize | None = "auto",
        batch_size: int = 1,
        on_error: OnError = "raise",
        prefetch: int | None = None,
        columnar: bool | Literal["arrow"] = False,
    ):
        if columnar not in (False, True, "arrow"):
            raise ConfigError(
                f"columnar={columnar!r}: use False (one record at a time), True (batches of numpy arrays) or "
                "'arrow' (pyarrow.RecordBatch batches)"
            )
        if int(seed) < 0:
            raise ConfigError(f"seed={seed} must be >= 0")
        if batch_size < 1:
            raise ConfigError(f"batch_size={batch_size} must be >= 1")
        equalize = None if equalize == "off" else equalize
        if equalize != "auto":
            equalized([0], equalize, batch_size)  # validates the name
        self.sources = sources
        self.format = fmt = fmt.for_sources(sources)
        self.shuffle = bool(shuffle)
        self.seed = int(seed)
        buffered = shuffle and shuffle_buffer > 1 and not fmt.one_record_per_source
        self.block_size = int(shuffle_buffer) if buffered else 1
        self.equalize = equalize
        self.batch_size = int(batch_size)
        self.columnar = bool(columnar)
        self.arrow = columnar == "arrow"  # column batches handed out as pyarrow.RecordBatch
        self.prefetch = _default_prefetch(sources) if prefetch is None else int(prefetch)
        self._errors = Errors(on_error)
        self._rank_arg = (rank, world_size)
        if rank is not None or world_size is not None:
            replica(rank, world_size)  # validate early
        self._replica: tuple[int, int] | None = None
        self._worker: tuple[int, int] | None = None
        self._counts: dict[Any, int] = {}  # records per file, per file piece (source, start, end), per table
        self._epoch = 0
        self._cursors: dict[int, Cursor] = {}
        self._readers: int | None = None
        self._saved_world: int | None = None  # the world size the cursors were saved with
        self._covers: set[int] = set()  # the readers whose position this state speaks for
        self._plan: list[tuple[int, int]] | None = None  # the epoch's unread record intervals (elastic)
        self._loader_workers: int | None = None  # set by a DataLoader in its process: readers per rank
        self._live: tuple[Chunk, Callable[[], int]] | None = None  # the chunk read, records consumed
        self._token: object = None
        self._fingerprint: str | None = None
        self._tallies: dict[int, Tally] = {}  # data audit (local-run --chaos): per reader, this epoch
        self._checkpointed = False  # state_dict() or load_state_dict() called here: a resumable reader

    # -- public API ---------------------------------------------------------------------------------
    @property
    def epoch(self) -> int:
        """The epoch the next iteration reads."""
        return self._epoch

    @property
    def skipped(self) -> int:
        """Bad records skipped so far in this process (``on_error="skip"``)."""
        return self._errors.skipped

    @property
    def equalized(self) -> bool:
        """True when every replica yields the same number of batches (one replica, or ``equalize`` active);
        a DDP loop over an unequalized reader with several replicas hangs at the last batch."""
        return self.topology().world_size == 1 or self._equalize_mode() is not None

    @property
    def files(self) -> list[str]:
        """The data files (empty for a BigQuery table)."""
        return [] if isinstance(self.sources, TableSource) else [s.uri for s in self.sources]

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch to read (its file order and shuffle depend on it).

        Setting the epoch a loaded state is in keeps that state's position, so
        ``load_state_dict(s); set_epoch(s["epoch"])`` resumes mid-epoch. On a ``bq://`` dataset whose
        session is planned, a new epoch replaces a session with less than an hour left: with several
        ranks every rank calls it at the same point (as a training loop does).
        """
        epoch = int(epoch)
        if epoch < 0:
            raise ConfigError(f"set_epoch({epoch}): epochs are >= 0")
        if epoch != self._epoch:
            self._end_audit(finished=False)
            self._epoch = epoch
            self._cursors = {}
            self._plan = None
            self._live = None
            self._token = None
            if self._streams is not None:
                self._table_streams()  # a session about to expire is renewed here, before workers start

    def topology(self) -> Topology:
        """This process's reader: replica (rank, world size) x DataLoader worker."""
        if self._replica is None:
            self._replica = replica(*self._rank_arg)
        rank, world = self._replica
        worker, workers = self._worker or dataloader_worker()
        return Topology(rank, world, worker, workers)

    def epoch_length(self) -> int | None:
        """Records (batches with ``columnar``) this reader yields in a whole epoch when ``equalize`` is in
        force (every reader the same number), else None: unknown without reading every file.

        Example:
            >>> open_dataset("gs://b/train-*.jsonl", rank=0, world_size=2).epoch_length()
            1024
        """
        if self._equalize_mode() is None:
            return None
        target = self._spec(self.topology()).target
        return None if target is None else -(-target // self.batch_size) if self.columnar else target

    def count(self) -> int:
        """Records in the whole dataset (reads every file once unless the format has metadata).

        A ``bq://`` table is counted from its metadata (committed rows, no read). With a ``row_filter``
        its Storage Read streams are read to count them, shared between the ranks: then every rank must
        call ``count()`` at the same point, like a collective.

        Example:
            >>> open_dataset("bq://p.d.t").count()
            100000
        """
        if isinstance(self.sources, TableSource) and not getattr(self.format, "row_filter", None):
            return self._table_rows()
        units = self._units(1)
        return sum(self._counted(units))

    def __iter__(self) -> Iterator[Any]:
        # The records are handed out by C iterators (a chain over lists decoded a run at a time), so no
        # Python frame runs per record; the live cursor is set as each run starts and counts what the
        # run's list iterator has handed out, so ``state_dict()`` between any two records is exact.
        return Records.of(self._runs())

    def _runs(self) -> Generator[Iterator[Any] | tuple[Any], None, None]:
        """Iterators over consecutive runs of this reader's records (see :meth:`__iter__`)."""
        topo = self.topology()
        self.adopt(topo.world_size, topo.readers)
        spec = self._spec(topo)
        cursor = self._cursors.get(topo.reader, Cursor())
        check_against(spec, cursor, topo.reader)
        errors = self._errors
        token = object()
        self._token = token
        self._readers = topo.readers
        if self.prefetch > 0:
            source: Iterator[Chunk] = Prefetcher(lambda: chunks(spec, cursor, errors), self.prefetch)
        else:
            source = chunks(spec, cursor, errors)
        decode = self.format.decoder()
        tally = self._tally(topo.reader)
        finished = False
        try:
            if self.columnar:
                yield from zip(self._batches(source, tally))  # one-batch tuples
            for chunk in () if self.columnar else source:
                raws = chunk.records
                if tally is not None:
                    tally.enter(raws)
                if decode is None:
                    records = iter(raws)
                    self._live = (chunk, partial(_consumed, len(raws), records))
                    yield records
                    continue
                for lo in range(0, len(raws), DECODE_RUN):
                    run = raws[lo : lo + DECODE_RUN]
                    try:
                        decoded = list(map(decode, run))
                    except Exception:  # noqa: BLE001 - a bad record: decoded one by one below
                        yield from self._careful(chunk, lo, run, decode)
                        continue
                    records = iter(decoded)
                    self._live = (chunk, partial(_consumed, lo + len(run), records))
                    yield records
            finished = True
        finally:
            if isinstance(source, Prefetcher):
                source.close()
            if self._token is token:
                if finished:
                    self._end_audit(finished=True)
                    self._epoch += 1
                    self._cursors = {}
                    self._plan = None
                else:
                    live = self._live_cursor()
                    if live is not None:
                        self._cursors[topo.reader] = live
                    if tally is not None:
                        self._audit_live(tally, leave=True)
                self._live = None
                self._token = None

    def _careful(
        self, chunk: Chunk, lo: int, run: list[Any], decode: Callable[[Any], Any]
    ) -> Iterator[tuple[Any]]:
        """``run`` (raws ``lo...`` of ``chunk``, one of them bad) decoded one record at a time: every record
        before a bad one is handed out, then the bad one is reported (raise, or skip and count)."""
        records = iter(run)
        self._live = (chunk, partial(_consumed, lo + len(run), records))
        for raw in records:
            try:
                value = decode(raw)
            except Exception as err:  # noqa: BLE001 - the format says what a bad record is
                if not self.format.ignorable(raw):
                    self._errors.bad(self.format.describe(raw, chunk.origins, err))
                continue
            yield (value,)

    def state_dict(self) -> dict[str, Any]:
        """A small JSON-serializable cursor: epoch, per-reader position, shuffle block (O(1) in the data)."""
        topo = self.topology()
        if self._live is None:
            readers = topo.world_size * self._loader_workers if self._loader_workers else topo.readers
            with contextlib.suppress(DataError):  # it cannot move: saved as loaded, iterating says why
                self.adopt(topo.world_size, readers)
        cursors = dict(self._cursors)
        live = self._live_cursor()
        if live is not None:
            cursors[topo.reader] = live
        session: dict[str, Any] = {}
        if isinstance(self.sources, TableSource):  # the read session, to read the same streams on resume
            from vertexrt.data.bigquery_storage import session_record

            planned = self._streams[0] if self._streams is not None else None
            if planned:
                counts = [self._counts.get(i) for i in range(len(planned))]
                known = None if None in counts else counts
                session["session"] = session_record(planned, known)  # type: ignore[arg-type]
            else:
                session["session"] = self._session and json.loads(json.dumps(self._session))
        saved = {str(reader): cursor.to_dict() for reader, cursor in sorted(cursors.items())}
        self._checkpointed = True
        if self._tallies:
            self._audit_state(saved, topo.reader)
        return {
            **session,
            "version": STATE_VERSION,
            "epoch": self._epoch,
            "fingerprint": self.fingerprint(),
            "options": self._options(),
            "readers": self._readers if cursors else None,
            "world_size": (self._saved_world or topo.world_size) if cursors else None,
            "elastic": self._elastic(),
            "plan": self._plan,
            "covers": sorted(self._covers | {topo.reader}),
            "cursors": saved,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state`` (from :meth:`state_dict`) with the next unseen record.

        Raises:
            DataError: the state belongs to other data or other shuffle/sharding options.
        """
        if not isinstance(state, dict) or state.get("version") != STATE_VERSION:
            raise DataError(f"not a vertexrt data state (version {STATE_VERSION}): {str(state)[:200]}")
        if state.get("fingerprint") != self.fingerprint():
            raise DataError(
                "this data state was saved for different data or options "
                f"({self._mismatch(state.get('options'))}): "
                "open the dataset exactly as when the state was saved, or start the epoch afresh without "
                "this state"
            )
        session = None
        if isinstance(self.sources, TableSource):  # checked before anything changes: the saved read session
            from vertexrt.data.bigquery_storage import check_record

            session = check_record(state.get("session"))
            if session:  # one of another table, other columns or another filter is a DataError
                self.format.check_saved(self.sources, session)  # type: ignore[attr-defined]
        self._epoch, self._cursors, self._readers, self._saved_world, self._covers, self._plan = _checked(
            state
        )
        self._tallies = _tallies(state, self._epoch) if audit.active() else {}
        self._checkpointed = True
        self._live = None
        self._token = None
        if isinstance(self.sources, TableSource):
            # The next plan reads the saved session's streams again while it lives (exact resume). A plan
            # made before (a DataLoader plans when it is made) is replaced here, without a broadcast
            # (each rank holds the same saved session) and with the saved counts, so that DataLoader
            # workers that start next read the saved streams and count nothing.
            from vertexrt.data.bigquery_storage import log_new_session

            self._session = saved = session
            self._renew_epoch = self._epoch
            planned = self._streams[0] if self._streams is not None else None
            if self._cursors and planned and (saved is None or planned[0].session != saved["name"]):
                reused = self.format.reuse(self.sources, saved) if saved else None  # type: ignore[attr-defined]
                if reused and (saved["counts"] or self._equalize_mode() is None):  # type: ignore[index]
                    self._streams = (reused,)
                    self._counts = {key: n for key, n in self._counts.items() if not isinstance(key, int)}
                    self._counts.update(enumerate(saved["counts"] or []))  # type: ignore[index]
                else:
                    log_new_session(self.sources.table_id, saved, planned[0].session)

    def adopt(self, world_size: int, readers: int) -> None:
        """Make a loaded mid-epoch state fit ``readers`` readers (``world_size`` x DataLoader workers): a
        no-op for the topology it was saved with; else the epoch's unread records are shared out afresh.

        Raises:
            DataError: the state cannot move to another topology (a shuffle buffer's cursor, a file-level
                layout, or the positions of some readers missing); the message names both topologies.
        """
        old = self._readers
        if not self._cursors or old in (None, readers):
            return
        old_world = self._saved_world or old
        where = (
            f"this data state was saved with world_size={old_world} x {old // old_world} DataLoader "
            f"workers ({old} readers) and this job has world_size={world_size} x {readers // world_size} "
            f"({readers} readers)"
        )
        if self.block_size > 1:
            raise DataError(
                f"{where}: a shuffle_buffer={self.block_size} cursor only resumes on the same readers. "
                f"Resume with {old} readers, start the next epoch (set_epoch({self._epoch + 1}) or leave the "
                "data state out), or open the dataset with shuffle_buffer=1 (the file order is still "
                "shuffled) so that its state can move to another world size"
            )
        if not self._elastic_at(old_world):
            raise DataError(
                f"{where}: a state of equalize=None reading whole files per reader only resumes on the "
                f"same readers. Resume with {old} readers, start the next epoch "
                f"(set_epoch({self._epoch + 1})), or open the dataset with equalize='drop_remainder' (or "
                "'pad') so its state can move"
            )
        missing = sorted(set(range(old)) - self._covers)
        if missing:
            raise DataError(
                f"{where}, but the state holds the positions of readers {sorted(self._covers)} only (missing "
                f"{missing[:8]}): pass the states of every rank merged by "
                "vertexrt.data.dataset.merge_states([...]) (gather them with "
                "torch.distributed.all_gather_object when saving)"
            )
        order = self._order(old)
        plan = _within(self._plan, sum(self._unit_counts(order)))
        consumed = {}
        for reader in range(old):
            cursor = self._cursors.get(reader, Cursor())
            full = sum(end - start for start, end in share(plan, reader, old))
            consumed[reader] = cursor.consumed if cursor.phase == OWN else full
        self._plan = remaining(plan, old, consumed)
        logger.info(
            "%s: %d records of the epoch left, shared out afresh", where, sum(b - a for a, b in self._plan)
        )
        self._cursors = {}
        self._covers = set()
        self._readers = None
        self._saved_world = None
        self._tallies = {}  # the readers' tallies do not map onto new readers: the audit restarts

    def _elastic(self) -> bool:
        """True when this dataset's state can resume on another topology (contiguous shares, no buffer)."""
        return self._elastic_at(self.topology().world_size)

    def _elastic_at(self, world_size: int) -> bool:
        if self.block_size > 1 or isinstance(self.sources, TableSource):
            return False
        return self._plan is not None or self._equalize_mode(world_size) is not None

    def fingerprint(self) -> str:
        """A short hash of what the cursor's meaning depends on (data files, format, options)."""
        if self._fingerprint is None:
            self._fingerprint = self._compute_fingerprint()
        return self._fingerprint

    def _compute_fingerprint(self) -> str:
        if isinstance(self.sources, TableSource):
            data: Any = self.sources.table_id
        else:
            data = [(s.uri, s.size, s.version) for s in self.sources]
        options = self._options()
        blob = json.dumps(
            [
                options["format"],
                data,
                *(options[name] for name in ("shuffle", "seed", "shuffle_buffer", "equalize", "batch_size")),
                *(["columnar"] if self.columnar else []),
            ],
            sort_keys=True,
            default=str,
        )
        return hashlib.sha1(blob.encode()).hexdigest()[:16]

    def _options(self) -> dict[str, Any]:
        """What the cursor's meaning depends on, by option name (small: saved in every state)."""
        versions = None
        if isinstance(self.sources, TableSource):
            files: Any = self.sources.table_id
        else:
            files = f"{len(self.sources)} files of {sum(s.size for s in self.sources)} bytes"
            versions = hashlib.sha1("\n".join(s.version for s in self.sources).encode()).hexdigest()[:12]
        fmt = repr(self.format)
        if len(fmt) > 160:  # e.g. Files with a thousand class names: the state stays small
            fmt = f"{fmt[:80]}... (sha1 {hashlib.sha1(fmt.encode()).hexdigest()[:12]})"
        return {
            "files": files,
            "versions": versions,
            "format": fmt,
            "shuffle": self.shuffle,
            "seed": self.seed,
            "shuffle_buffer": self.block_size,
            "equalize": self.equalize,
            "batch_size": self.batch_size,
            "columnar": self.columnar,
        }

    def _mismatch(self, saved: Any) -> str:
        """Which options differ from the ones a state was saved with (``saved``: its ``options``)."""
        if not isinstance(saved, dict):
            return "files, sizes, format, shuffle, seed, shuffle_buffer, equalize or batch_size"
        now = self._options()
        changed = [
            f"{k}: saved {saved.get(k)}, now {v}"
            for k, v in now.items()
            if saved.get(k) != v and k != "versions"
        ]
        if not changed and saved.get("versions") != now["versions"]:
            changed = [
                "files: a file was rewritten since the state was saved (same names and sizes, other content "
                "on Cloud Storage or a new modification time on local disk), so the saved positions may fall "
                "elsewhere (a job that copies its data to local disk at each start keeps the modification "
                "times, e.g. `cp -p`, or reads it from gs:// or /gcs/ directly)"
            ]
        if not changed:  # same counts and sizes: a file was renamed or replaced by one of the same size
            changed = [f"files: the file names changed ({now['files']})"]
        return "; ".join(changed)

    def as_torch(self, num_workers: int = 0) -> TorchIterable:
        """A ``torch.utils.data.IterableDataset`` for a DataLoader; pass the DataLoader's ``num_workers`` so
        the shared work (``equalize`` record counts) is done once here, before the workers fork. See
        :class:`vertexrt.data.torch.TorchIterable`.

        Example:
            >>> loader = torch.utils.data.DataLoader(ds.as_torch(num_workers=4), batch_size=32, num_workers=4)
        """
        from vertexrt.data.torch import TorchIterable

        return TorchIterable(self, num_workers)

    def as_tf(self, output_signature: Any = None) -> tf.data.Dataset:
        """A ``tf.data.Dataset`` over this dataset (signature inferred from the first record if omitted).

        It is already this replica's share: it carries ``AutoShardPolicy.OFF`` so ``tf.distribute`` does
        not shard it again, and its cardinality when :meth:`epoch_length` is known; see
        :func:`vertexrt.data.tf.to_tf`.
        """
        from vertexrt.data.tf import to_tf

        return to_tf(self, output_signature)

    # -- internals ----------------------------------------------------------------------------------
    def _live_cursor(self) -> Cursor | None:
        if self._live is None:
            return None
        chunk, consumed = self._live
        return chunk.cursor_after(consumed())

    def _batches(self, source: Iterator[Chunk], tally: Tally | None = None) -> Iterator[Any]:
        """Column batches of ``batch_size`` rows across chunk boundaries (``pyarrow.RecordBatch`` with
        ``columnar="arrow"``, else ``{name: numpy array}``, each chunk converted once); at each batch handed
        out the live cursor is right after its last row. Blocks of another schema raise a DataError."""
        size = self.batch_size
        pending: list[Any] = []
        have = done = 0
        chunk = None
        first: Columns | None = None
        for chunk in source:
            cols: Any = chunk.records
            if first is None:
                first = cols
            same_schema(first, cols)
            block = cols  # Arrow rows, for the data audit
            if not self.arrow:
                cols = cols.numpy()
            done = 0
            while done < len(cols):
                piece = cols[done : done + size - have]
                if tally is not None:  # every piece is handed out by the next yield
                    tally.fold_rows(block[done : done + len(piece)].batch)
                pending.append(piece)
                have += len(piece)
                done += len(piece)
                if have == size:
                    self._live = (chunk, partial(int, done))
                    batch, pending, have = concat(pending), [], 0
                    yield batch.batch if self.arrow else batch.data
        if have and chunk is not None:
            self._live = (chunk, partial(int, done))
            batch = concat(pending)
            yield batch.batch if self.arrow else batch.data

    def _units(self, readers: int) -> list[Unit]:
        streams = self._table_streams()
        if streams is not None:
            return [Unit(i) for i in range(len(streams))]
        if isinstance(self.sources, TableSource):
            rows = self._table_rows()
            parts = max(1, readers)
            return [Unit(0, rows * i // parts, rows * (i + 1) // parts) for i in range(parts)]
        return [Unit(i) for i in range(len(self.sources))]

    def _order(self, readers: int) -> list[Unit]:
        """The epoch's unit order: files shuffled by ``(seed, epoch)``; with fewer files than readers each
        file that can be split is cut into pieces, in file order (about 4 per reader in all), so a reader
        reads about its share of the bytes and the record order is the same however files are cut."""
        order = epoch_order(self._units(readers), self.seed, self._epoch, self.shuffle)
        if isinstance(self.sources, TableSource) or len(order) >= readers:
            return order
        files = [self.sources[unit.source] for unit in order]
        out = []
        for unit, source, parts in zip(
            order, files, pieces([f.size for f in files], 4 * readers), strict=True
        ):
            cut = self.format.split(source, parts, self.columnar) if parts > 1 else None
            out.extend([Unit(unit.source, a, b) for a, b in cut] if cut else [unit])
        return out

    def _table_rows(self) -> int:
        """The table's rows from its metadata (kept apart from the per-stream counts, keyed by index)."""
        if "table" not in self._counts:
            self._counts["table"] = self.format.count(self.sources, self._errors)
        return self._counts["table"]

    def _unit_counts(self, units: Sequence[Unit]) -> list[int]:
        out = []
        for unit in units:
            if unit.end is not None and isinstance(self.sources, TableSource):
                out.append(unit.end - unit.start)
                continue
            if unit.end is not None:
                key = (unit.source, unit.start, unit.end)
                if key not in self._counts:
                    source = self.sources[unit.source]  # type: ignore[index]  # a file piece
                    self._counts[key] = self.format.count_piece(source, unit.start, unit.end, self._errors)
                out.append(self._counts[key])
                continue
            if unit.source not in self._counts:
                self._counts[unit.source] = self.format.count(self.sources[unit.source], self._errors)  # type: ignore[index]
            out.append(self._counts[unit.source])
        return out

    def _equalize_mode(self, world_size: int | None = None) -> str | None:
        """The equalize mode in force: ``"auto"`` is ``"drop_remainder"`` with several replicas, else none."""
        if self.equalize == "auto":
            world = self.topology().world_size if world_size is None else world_size
            return "drop_remainder" if world > 1 else None
        return self.equalize

    _streams: tuple[list[Any] | None] | None = None  # a table's Storage Read plan, once made
    _session: dict[str, Any] | None = None  # the read session of a loaded state, until planned
    _renew_epoch: int | None = None  # the epoch whose start last checked the session's expiry

    def prepare(self) -> None:
        """Do the work every reader shares once, before forking DataLoader workers: plan a table's Storage
        Read streams (one session, created by the chief and shared with every rank; at an epoch start, a
        new one when it has less than an hour left), count the records of every unit for ``equalize``.
        Iterating does it on first use too.

        Example:
            >>> ds = open_dataset("bq://p.d.t"); ds.prepare()   # every rank, like a collective
        """
        if self._streams is not None and self._streams[0] is not None:
            self._renew()
        self._table_streams()
        readers = self._planned_readers()
        if self._equalize_mode() is not None or self._contiguous(readers):
            self._counted(self._order(readers))

    def _planned_readers(self) -> int:
        """The readers of this job: replicas x the DataLoader workers of each (as set by the loader)."""
        topo = self.topology()
        return topo.world_size * (topo.num_workers if self._worker else self._loader_workers or 1)

    def _contiguous(self, readers: int) -> bool:
        """True when each reader takes a contiguous share of the epoch's records (:func:`balanced`, which
        needs every unit's count): files with ``equalize`` or an elastic plan; Storage Read streams (a
        reader starts at an exact row) with ``equalize`` or fewer streams than readers."""
        if isinstance(self.sources, TableSource):
            streams = self._table_streams()
            return bool(streams) and (self._equalize_mode() is not None or len(streams or ()) < readers)
        return self._equalize_mode() is not None or self._plan is not None

    def _table_streams(self) -> list[Any] | None:
        """A table's Storage Read streams (``format.plan``, once per process: it may broadcast), or None:
        files, or a table read with ``list_rows`` row ranges. In a rank's main process, the first call in a
        new epoch replaces a session about to expire (:meth:`_renew`; it broadcasts)."""
        if not isinstance(self.sources, TableSource) or not hasattr(self.format, "plan"):
            return None
        if self._streams is None:
            if _in_loader_worker():  # each worker would make its own session: plan in the rank's process
                raise ConfigError(
                    f"bq://{self.sources.table_id}: the read session is planned in each rank's main process "
                    "before DataLoader workers start: call ds.prepare() there (as_torch() and "
                    "vertexrt.data.torch.DataLoader do)"
                )
            topo = self.topology()
            saved = self._session if self._cursors else None
            streams = self.format.plan(
                self.sources, topo.rank, topo.world_size, resume=saved, readers=self._planned_readers()
            )
            self._streams = (streams,)
            self._renew_epoch = self._epoch
            if streams and saved and streams[0].session == saved["name"]:
                self._counts.update(enumerate(saved["counts"] or []))  # counted when it was saved
            elif streams and self._cursors:
                from vertexrt.data.bigquery_storage import log_new_session

                log_new_session(self.sources.table_id, saved, streams[0].session)
        elif self._renew_epoch != self._epoch and self._streams[0] is not None and not _in_loader_worker():
            self._renew()
        return self._streams[0]

    def _renew(self) -> None:
        """Replace the planned session by a new one if it has less than an hour left and the chief is at
        an epoch start (every rank calls it at the same point: the chief decides and broadcasts), so
        DataLoader workers never meet an expired session and make sessions of their own."""
        streams = self._streams[0] if self._streams else None
        self._renew_epoch = self._epoch
        if not streams:
            return
        topo = self.topology()
        readers = self._planned_readers()
        fresh = self.format.renew(  # type: ignore[attr-defined]
            self.sources, streams, topo.rank, topo.world_size, mid_epoch=bool(self._cursors), readers=readers
        )
        if fresh and fresh[0].session != streams[0].session:
            self._streams = (fresh,)
            self._counts = {key: n for key, n in self._counts.items() if not isinstance(key, int)}
            if self._contiguous(readers):
                self._counted(self._order(1))  # every rank is here: count the new streams together

    def _counted(self, units: Sequence[Unit]) -> list[int]:
        """:meth:`_unit_counts`, Storage Read streams included (every rank calls it: the ranks share the
        work of reading each stream once to count its rows, kept under the stream's index)."""
        with long_phase("counting records"):  # before an epoch's first batch: not a hang
            return self._counted_now(units)

    def _counted_now(self, units: Sequence[Unit]) -> list[int]:
        streams = self._table_streams() or []
        if any(unit.source not in self._counts for unit in units if streams):
            topo = self.topology()
            # a DataLoader worker not prepared for (as_torch() without num_workers) counts alone: a
            # collective from a worker would wait for ranks that never join it
            rank, world = (0, 1) if _in_loader_worker() else (topo.rank, topo.world_size)
            counts = self.format.count_streams(streams, rank, world)  # type: ignore[attr-defined]
            self._counts.update(enumerate(counts))
        return self._unit_counts(units)

    def _spec(self, topo: Topology) -> StreamSpec:
        order = self._order(topo.readers)
        target = None
        mode = self._equalize_mode()
        if self._contiguous(topo.readers):
            unit_counts = self._counted(order)
            plan = _within(self._plan, sum(unit_counts))
            units, stride, offset = balanced(order, unit_counts, topo.reader, topo.readers, plan), 1, 0
            if isinstance(self.sources, TableSource):  # a stream's rows [a, b): read from row a, stop at b
                units = [Unit(u.source, 0, u.end - u.start, True, u.start, u.end) for u in units]  # type: ignore[operator]
            counts = [sum(b - a for a, b in share(plan, r, topo.readers)) for r in range(topo.readers)]
            target = equalized(counts, mode, self.batch_size)
        else:
            units, stride, offset = assign(order, topo.reader, topo.readers)
            if mode is not None:
                counts = reader_counts(order, self._counted(order), topo.readers)
                target = equalized(counts, mode, self.batch_size)
        sources: Sequence[Any] | None = self._table_streams()
        if sources is None:
            sources = [self.sources] if isinstance(self.sources, TableSource) else self.sources
        return StreamSpec(
            fmt=self.format,
            sources=sources,
            units=units,
            stride=stride,
            offset=offset,
            pad_units=order,
            target=target,
            block_size=self.block_size,
            seed=self.seed,
            epoch=self._epoch,
            reader=topo.reader,
            readers=topo.readers,
            columnar=self.columnar,
        )

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_live"] = None
        state["_token"] = None
        state["_tallies"] = {reader: tally.detached() for reader, tally in self._tallies.items()}
        state.pop("_audit_exit", None)
        state["_checkpointed"] = False  # a copy (a probe, a spawned worker): audited once its state is taken
        return state

    # -- data audit (local-run --chaos, see vertexrt.data.digest) -------------------------------------
    def _tally(self, reader: int) -> Tally | None:
        """This reader's tally of the epoch when auditing, else None (one check of a cached flag)."""
        if not audit.active():
            return None
        tally = self._tallies.get(reader)
        if tally is None or tally.epoch != self._epoch:
            tally = self._tallies[reader] = Tally(self._epoch)
        if not self.__dict__.get("_audit_exit"):  # an epoch the process leaves unfinished is reported too
            self._audit_exit = True
            atexit.register(self._end_audit, False)  # keeps the dataset to the end: auditing only
        return tally

    def _audit_live(self, tally: Tally, leave: bool = False) -> None:
        """Fold what the consumer took of the chunk being handed out; ``leave``: the pass ends here (the
        rest of the chunk is not delivered)."""
        if self._live is not None and not self.columnar:
            chunk, consumed = self._live
            if tally.chunk is chunk.records:
                tally.catch_up(consumed())
        if leave:
            tally.chunk = None

    def _audit_state(self, saved: dict[str, Any], reader: int) -> None:
        """Put each reader's tally beside its cursor in a state being saved."""
        live = self._tallies.get(reader)
        if live is not None and self._live is not None:
            self._audit_live(live)
        for key, cursor in saved.items():
            tally = self._tallies.get(int(key))
            if tally is not None and tally.epoch == self._epoch:
                cursor["audit"] = tally.to_dict()

    def _audit_identity(self) -> str:
        """Which dataset this is, the same in every run of a job: the file names and sizes (not their
        directory: a job may write its data under its own output directory) and the options."""
        files = self.sources.table_id if isinstance(self.sources, TableSource) else self.files
        names = [str(uri).rsplit("/", 1)[-1] for uri in ([files] if isinstance(files, str) else files)]
        options = {k: v for k, v in self._options().items() if k != "versions"}
        blob = json.dumps([names, options], sort_keys=True, default=str)
        return hashlib.sha1(blob.encode()).hexdigest()[:16]

    def _end_audit(self, finished: bool) -> None:
        """Report this process's reader's tally of the epoch it leaves (read to its end, or left), when the
        reader is checkpointed (its state saved or loaded here; a validation reader read afresh each time is
        not)."""
        tally = self._tallies.pop(self.topology().reader, None) if self._tallies else None
        self._tallies = {}
        if tally is None or tally.epoch != self._epoch or not self._checkpointed:
            return
        if finished:
            tally.enter(None)
        else:
            self._audit_live(tally, leave=True)
        audit.event(
            "data_epoch",
            data=self._audit_identity(),
            source=self.files[0].rsplit("/", 1)[-1] if self.files else str(self.sources.table_id),  # type: ignore[union-attr]
            epoch=self._epoch,
            reader=self.topology().reader,
            readers=self._readers or self.topology().readers,
            count=tally.count,
            digest=f"{tally.digest:016x}",
            finished=finished,
            read=tally.read,
        )

    def __repr__(self) -> str:
        what = (
            self.sources.table_id if isinstance(self.sources, TableSource) else f"{len(self.sources)} files"
        )
        return f"Dataset({what}, format={self.format!r}, shuffle={self.shuffle}, seed={self.seed})"


class Records(chain):  # type: ignore[type-arg]
    """One pass over a dataset's records: a C iterator (no Python frame per record) that, like a generator,
    can be closed early — the reader's place is kept for ``state_dict()`` and its read-ahead stops.

    Example:
        >>> it = iter(ds); first = next(it); it.close()  # doctest: +SKIP
    """

    _runs: Generator[Any, None, None]

    @classmethod
    def of(cls, runs: Generator[Any, None, None]) -> Records:
        records: Records = cls.from_iterable(runs)  # type: ignore[assignment]  # cls's own instance
        records._runs = runs
        return records

    def close(self) -> None:
        """End the pass here: the place is recorded, and what is left of the current run is dropped."""
        self._runs.close()
        deque(self, maxlen=0)  # the run already handed to the chain; the closed generator gives no more


def open_dataset(
    uri: str | Sequence[str] | None = None,
    format: str | Format | None = None,  # noqa: A002 - the natural name for it
    *,
    shuffle: bool = True,
    seed: int = 0,
    shuffle_buffer: int = 10_000,
    rank: int | None = None,
    world_size: int | None = None,
    equalize: Equalize | None = "auto",
    batch_size: int = 1,
    on_error: OnError = "raise",
    prefetch: int | None = None,
    split: Literal["training", "validation", "test"] = "training",
    columnar: bool | Literal["arrow"] = False,
) -> Dataset:
    """Open files or a BigQuery table as a sharded, shuffled, exactly-once, resumable record stream.

    Args:
        uri: a local path, ``/gcs/`` path or ``gs://`` URI (a file, a directory, a wildcard, or a
            comma-separated list), or ``bq://project.dataset.table``. Default: ``AIP_<SPLIT>_DATA_URI``.
            A table is read through the BigQuery Storage Read API: the chief opens one read session at
            ``prepare()`` or the first iteration and shares its streams with every rank (over
            ``torch.distributed`` when several ranks); ``list_rows`` where the API is not enabled, or with
            ``BigQuery(storage_api=False)``.
        format: ``"jsonl"``, ``"csv"``, ``"tfrecord"``, ``"parquet"``, ``"bigquery"``, ``"files"`` (whole
            binary files such as images, see :class:`~vertexrt.data.formats.files.Files`) or a format object
            (``CSV(types=...)``, ``TFRecord(example=True)``, ...). Default: ``AIP_DATA_FORMAT`` for the
            environment's URI, else the file extension.
        shuffle: shuffle the file order and, within blocks of ``shuffle_buffer`` records, the records;
            seeded by ``(seed, epoch)``.
        rank, world_size: this replica; default torch.distributed when initialised, else the cluster.
        equalize: make every reader yield the same number of records, a multiple of ``batch_size``, so
            every replica runs the same number of batches (unequal batch counts hang DDP). The default
            ``"auto"`` is ``"drop_remainder"`` when there are several replicas (each reads the smallest share,
            rounded down to whole batches; at most ``readers x batch_size`` records of an epoch go unread)
            and nothing with one. ``"pad"`` repeats records up to the largest share instead; ``None`` (or
            ``"off"``) reads every record exactly once with unequal shares. Equalizing counts every file's
            records once (a read of each file unless the format has metadata); ``ds.equalized`` says
            whether it is in force.
        on_error: ``"raise"`` a :class:`~vertexrt.errors.DataError` naming file and line/byte, or ``"skip"``
            bad records and count them in ``ds.skipped``.
        prefetch: chunks read ahead by a background thread; default 2 for Cloud Storage (``gs://``,
            ``/gcs/``) and BigQuery, 0 (read in the iterating thread) for local disk, where a second
            Python thread only competes for the GIL.
        split: which ``AIP_*_DATA_URI`` to use when ``uri`` is None.
        columnar: yield column batches, ``{column: numpy array}`` of ``batch_size`` rows (the last one of
            an unequalized epoch may be shorter), read by Arrow without a per-row step: Parquet, CSV
            (pyarrow's reader; columns without ``types`` get Arrow's inferred types) and JSONL. Sharding,
            shuffle (rows are permuted within and across the ``shuffle_buffer`` rows read) and the exact
            cursor are those of the row path; resuming a CSV or JSONL file mid-way re-reads it up to the
            cursor. ``as_torch()`` / ``as_tf()`` hand the columns over as tensors.
            ``columnar="arrow"`` yields the same batches as ``pyarrow.RecordBatch`` with no numpy
            conversion (the fastest: for Arrow-native pipelines, or string / list columns you process
            yourself); BigQuery Storage Read streams too. ``as_torch()`` / ``as_tf()`` convert its batches
            as for ``True`` (numeric columns zero-copy, strings as numpy object arrays / ``tf.string``).
            Files whose columns or types differ raise a DataError naming the file and the column.

    Example:
        >>> ds = open_dataset("gs://my-bucket/export/training-*", format="jsonl", seed=7)
        >>> for record in ds: ...
    """
    env_format = None
    if uri is None:
        from vertexrt.env import environment

        env = environment()
        uri = {
            "training": env.training_data_uri,
            "validation": env.validation_data_uri,
            "test": env.test_data_uri,
        }.get(split)
        if split not in ("training", "validation", "test"):
            raise ConfigError(f"split={split!r}: use 'training', 'validation' or 'test'")
        if not uri:
            raise ConfigError(
                f"no uri given and AIP_{split.upper()}_DATA_URI is not set: pass uri=..., run with a "
                f"Vertex managed dataset, or simulate one with `vertexrt local-run --{split}-data URI`"
            )
        env_format = env.data_format
    fmt = _format(uri, format, env_format)
    sources: Sequence[FileSource] | TableSource
    if fmt is not None and fmt.name == "bigquery":
        if not isinstance(uri, str):
            raise ConfigError("a BigQuery source is one table URI, not a list")
        sources = parse_table(uri)
    else:
        sources = expand_files(uri)
        fmt = fmt or _guess(sources, uri)
        if sources and all(s.size == 0 for s in sources):
            raise DataError(
                f"every file of {uri!r} is empty ({len(sources)} files): there is no data to read"
            )
    return Dataset(
        sources,
        fmt,
        shuffle=shuffle,
        seed=seed,
        shuffle_buffer=shuffle_buffer,
        rank=rank,
        world_size=world_size,
        equalize=equalize,
        batch_size=batch_size,
        on_error=on_error,
        prefetch=prefetch,
        columnar=columnar,
    )


def _in_loader_worker() -> bool:
    """True inside a torch DataLoader worker process."""
    import sys

    data = sys.modules.get("torch.utils.data")
    return data is not None and data.get_worker_info() is not None


def merge_states(states: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One data state from the states of every rank (each holds its own readers' positions), to resume
    on another world size.

    A rank that already finished the epoch (its state is at the next epoch) counts as done.

    Example:
        >>> everyone = [None] * world_size
        >>> torch.distributed.all_gather_object(everyone, loader.state_dict())
        >>> state = merge_states(everyone)     # save it; load it with any world size
    """
    from vertexrt.data.cursor import DONE

    if not states:
        raise DataError("merge_states([]): pass the data state of every rank")
    for state in states:  # each checked as load_state_dict checks it: a damaged one is named, not merged
        if not isinstance(state, dict) or state.get("version") != STATE_VERSION:
            raise DataError(
                f"merge_states: not a vertexrt data state (version {STATE_VERSION}): {str(state)[:200]}"
            )
        _checked(state)
    epoch = min(int(s["epoch"]) for s in states)
    merged: dict[str, Any] = {**states[0], "epoch": epoch, "cursors": {}, "covers": []}
    covers: set[int] = set()
    for state in states:
        if state.get("fingerprint") != merged.get("fingerprint"):
            raise DataError(
                "merge_states: the states belong to different data or options (fingerprints "
                f"{merged.get('fingerprint')} and {state.get('fingerprint')}): merge one dataset's states"
            )
        readers = state.get("readers")
        if readers is not None and merged.get("readers") not in (None, readers):
            raise DataError(f"merge_states: states saved with {merged['readers']} and {readers} readers")
        for key in ("readers", "world_size", "plan"):
            if merged.get(key) is None:
                merged[key] = state.get(key)
        covers.update(int(r) for r in state.get("covers", state["cursors"]))
        if int(state["epoch"]) == epoch:
            merged["cursors"].update(state["cursors"])
        elif int(state["epoch"]) == epoch + 1:  # this rank finished the epoch
            for reader in state.get("covers", []):
                merged["cursors"][str(reader)] = Cursor(phase=DONE).to_dict()
        else:
            raise DataError(f"merge_states: states of epochs {epoch} and {state['epoch']} cannot be merged")
    merged["covers"] = sorted(covers)
    merged["cursors"] = dict(sorted(merged["cursors"].items(), key=lambda kv: int(kv[0])))
    return merged


def _checked(
    state: dict[str, Any],
) -> tuple[int, dict[int, Cursor], int | None, int | None, set[int], list[tuple[int, int]] | None]:
    """``(epoch, cursors, readers, world_size, covers, plan)`` of a loaded state, each field checked against
    its type and bounds (a damaged or edited state raises a DataError naming the field, never a raw error)."""
    epoch = check_count("epoch", state.get("epoch"))
    readers, world = state.get("readers"), state.get("world_size")
    for name, value in (("readers", readers), ("world_size", world)):
        if value is not None and check_count(name, value) < 1:
            raise DataError(state_problem(name, value, "is not >= 1"))
    if readers is not None and world is not None and readers % world:
        raise DataError(state_problem("readers", readers, f"is not a multiple of world_size={world}"))
    saved = state.get("cursors", {})
    if not isinstance(saved, dict):
        raise DataError(state_problem("cursors", saved, "is not an object of readers' cursors"))
    cursors = {}
    for key, value in saved.items():
        reader = int(key) if isinstance(key, str) and key.isdigit() else -1
        if reader < 0 or (readers is not None and reader >= readers):
            raise DataError(
                state_problem(f"cursors[{key!r}]", key, f"is not a reader of 0..{(readers or 1) - 1}")
            )
        if isinstance(value, dict) and "audit" in value:  # a data audit tally (see _tallies)
            value = {k: v for k, v in value.items() if k != "audit"}
        cursors[reader] = Cursor.from_dict(value, f"cursors[{key!r}]")
    if cursors and readers is None:
        raise DataError(state_problem("readers", readers, "is missing beside the cursors"))
    listed = state.get("covers", sorted(cursors))
    if not isinstance(listed, list) or any(
        type(r) is not int or not 0 <= r < (readers or MAX_COUNT) for r in listed
    ):
        raise DataError(state_problem("covers", listed, "is not a list of this state's readers"))
    plan = state.get("plan")
    if plan is None:
        return epoch, cursors, readers, world, set(listed), None
    if not isinstance(plan, list):
        raise DataError(state_problem("plan", plan, "is not a list of [start, end) intervals"))
    intervals: list[tuple[int, int]] = []
    for i, pair in enumerate(plan):
        if not isinstance(pair, list | tuple) or len(pair) != 2:
            raise DataError(state_problem(f"plan[{i}]", pair, "is not a [start, end) pair"))
        a, b = check_count(f"plan[{i}][0]", pair[0]), check_count(f"plan[{i}][1]", pair[1])
        if a >= b or (intervals and a < intervals[-1][1]):
            raise DataError(
                state_problem(f"plan[{i}]", pair, "is empty, reversed or overlaps the interval before")
            )
        intervals.append((a, b))
    return epoch, cursors, readers, world, set(listed), intervals


def _tallies(state: dict[str, Any], epoch: int) -> dict[int, Tally]:
    """The data audit tallies saved beside a checked state's cursors (none in a state saved unaudited)."""
    return {
        int(key): Tally.from_dict(epoch, cursor["audit"], f"cursors[{key!r}].audit")
        for key, cursor in state.get("cursors", {}).items()
        if isinstance(cursor, dict) and "audit" in cursor
    }


def _within(plan: list[tuple[int, int]] | None, total: int) -> list[tuple[int, int]]:
    """The epoch's unread intervals (``plan``, default all ``total`` records), refused if a loaded plan
    reaches past the records there are."""
    if plan is None:
        return [(0, total)]
    if plan and plan[-1][1] > total:
        raise DataError(state_problem("plan", plan[-1], f"reaches past the epoch's {total} records"))
    return plan


def _consumed(end: int, records: Iterator[Any]) -> int:
    """Records of a chunk handed out: ``records`` iterates over the chunk's records up to index ``end``."""
    return end - records.__length_hint__()  # type: ignore[attr-defined,no-any-return]


def _default_prefetch(sources: Sequence[FileSource] | TableSource) -> int:
    from vertexrt.paths import storage_kind

    if isinstance(sources, TableSource) or any(storage_kind(s.uri) != "local" for s in sources):
        return 2
    return 0


def validation_dataset(**kwargs: Any) -> Dataset:
    """:func:`open_dataset` on ``AIP_VALIDATION_DATA_URI`` (unshuffled unless ``shuffle=True``)."""
    kwargs.setdefault("shuffle", False)
    return open_dataset(split="validation", **kwargs)


def test_dataset(**kwargs: Any) -> Dataset:
    """:func:`open_dataset` on ``AIP_TEST_DATA_URI`` (unshuffled unless ``shuffle=True``)."""
    kwargs.setdefault("shuffle", False)
    return open_dataset(split="test", **kwargs)


test_dataset.__test__ = False  # type: ignore[attr-defined]  # not a pytest test


def _format(uri: str | Sequence[str], explicit: str | Format | None, env_format: str | None) -> Format | None:
    """The format named by the caller, the URI (bq://, extension) or AIP_DATA_FORMAT; None: see the files."""
    if isinstance(explicit, Format):
        return explicit
    if explicit is not None:
        return format_named(explicit)
    if isinstance(uri, str) and is_bigquery(uri):
        return format_named("bigquery")
    if env_format:
        return format_named(env_format)
    first = (uri.split(",") if isinstance(uri, str) else list(uri))[0].strip()
    return format_for_uri(first)


def _guess(sources: Sequence[FileSource], uri: str | Sequence[str]) -> Format:
    guessed = format_for_uri(sources[0].uri) if sources else None
    if guessed is None:
        raise ConfigError(
            f"cannot tell the data format of {uri!r} from its extension: pass format='jsonl' (or csv, "
            "tfrecord, parquet, bigquery, files) or set AIP_DATA_FORMAT"
        )
    return guessed

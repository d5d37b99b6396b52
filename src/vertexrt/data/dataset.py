"""The dataset object: iteration, epochs and the public API; it asks :mod:`~vertexrt.data.planning` for
each reader's share of an epoch (files by :class:`~vertexrt.data.planning.FileUnits`, a table by
:class:`~vertexrt.data.table_session.TableSession`), and :mod:`~vertexrt.data.resume_state` for its state.

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
import copy
import hashlib
import json
import logging
from collections.abc import Callable, Generator, Iterator, Sequence
from functools import partial
from typing import TYPE_CHECKING, Any, Literal

from vertexrt import audit
from vertexrt.data.columns import Columns, concat, same_schema
from vertexrt.data.cursor import OWN, Chunk, Cursor, StreamSpec, check_against, chunks
from vertexrt.data.digest import Tally
from vertexrt.data.formats.base import Errors, FileSource, Format, OnError
from vertexrt.data.planning import (
    FileUnits,
    Intervals,
    PlanContext,
    ReadOptions,
    UnitSource,
    counted,
    epoch_units,
    reader_spec,
    within,
)
from vertexrt.data.prefetch import Prefetcher
from vertexrt.data.records import Records, consumed
from vertexrt.data.resume_state import (
    STATE_VERSION,
    checked_state,
    fingerprint,
    mismatch,
    saved_tallies,
    short_format,
)
from vertexrt.data.sharding import Topology, Unit, dataloader_worker, equalized, remaining, replica, share
from vertexrt.data.sources import TableSource
from vertexrt.data.table_session import TableSession
from vertexrt.errors import ConfigError, DataError

if TYPE_CHECKING:
    import tensorflow as tf

    from vertexrt.data.torch import TorchIterable

logger = logging.getLogger(__name__)

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
        self._source: UnitSource = (
            TableSession(sources, fmt, self._errors)
            if isinstance(sources, TableSource)
            else FileUnits(sources, fmt, self.columnar, self._errors)
        )
        self._rank_arg = (rank, world_size)
        if rank is not None or world_size is not None:
            replica(rank, world_size)  # validate early
        self._replica: tuple[int, int] | None = None
        self._worker: tuple[int, int] | None = None
        self._epoch = 0
        self._cursors: dict[int, Cursor] = {}
        self._readers: int | None = None
        self._saved_world: int | None = None  # the world size the cursors were saved with
        self._held: set[int] = set()  # the readers whose positions this state holds (its "covers")
        self._unread: Intervals | None = None  # the epoch's unread record intervals (elastic; its "plan")
        self.loader_workers: int | None = None
        """DataLoader workers per rank reading it (set by :class:`vertexrt.data.torch.DataLoader`)."""
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
        return self._source.uris()

    @property
    def mid_epoch(self) -> bool:
        """True when a loaded state (or a pass cut short) positions some reader inside the current epoch."""
        return bool(self._cursors)

    @property
    def readers_in_state(self) -> frozenset[int]:
        """The readers whose positions a loaded state holds (all of them after :func:`merge_states`)."""
        return frozenset(self._held)

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
            self._unread = None
            self._live = None
            self._token = None
            self._source.new_epoch(
                self._context()
            )  # a session about to expire is renewed before workers start

    def set_loader_worker(self, worker: int, num_workers: int) -> None:
        """This process reads as DataLoader worker ``worker`` of ``num_workers`` (reader
        ``rank * num_workers + worker``); :class:`vertexrt.data.torch.TorchIterable` calls it in each worker.

        Example:
            >>> info = torch.utils.data.get_worker_info(); ds.set_loader_worker(info.id, info.num_workers)
        """
        if not 0 <= worker < num_workers:
            raise ConfigError(f"set_loader_worker({worker}, {num_workers}): use 0 <= worker < num_workers")
        self._worker = (worker, num_workers)

    def topology(self) -> Topology:
        """This process's reader: replica (rank, world size) x DataLoader worker."""
        if self._replica is None:
            self._replica = replica(*self._rank_arg)
        rank, world = self._replica
        worker, workers = self._worker or dataloader_worker()
        return Topology(rank, world, worker, workers)

    def epoch_length(self, num_workers: int | None = None) -> int | None:
        """Records (batches with ``columnar``) this reader yields in a whole epoch when ``equalize`` is in
        force (every reader the same number), else None: unknown without reading every file.
        ``num_workers``: as a reader of a rank read by that many DataLoader workers. The first call counts
        the records (shared between the ranks of a ``torch.distributed`` group: then every rank calls it,
        or :meth:`prepare`, at the same point).

        Example:
            >>> open_dataset("gs://b/train-*.jsonl", rank=0, world_size=2).epoch_length()
            1024
        """
        if self._equalize_mode() is None:
            return None
        with self._as_workers(num_workers):
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
        return self._source.total(self._context())

    def __iter__(self) -> Iterator[Any]:
        # The records are handed out by C iterators (a chain over lists decoded a run at a time), so no
        # Python frame runs per record; the live cursor is set as each run starts and counts what the
        # run's list iterator has handed out, so ``state_dict()`` between any two records is exact.
        return Records.of(self._runs())

    def _runs(self) -> Generator[Iterator[Any] | tuple[Any], None, None]:
        """Iterators over consecutive runs of this reader's records (see :meth:`__iter__`)."""
        topo = self.topology()
        self.reshare(topo.world_size, topo.readers)
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
                    self._live = (chunk, partial(consumed, len(raws), records))
                    yield records
                    continue
                for lo in range(0, len(raws), DECODE_RUN):
                    run = raws[lo : lo + DECODE_RUN]
                    try:
                        decoded = list(map(decode, run))
                    except Exception:  # noqa: BLE001 - a bad record: decoded one by one below
                        yield from self._one_by_one(chunk, lo, run, decode)
                        continue
                    records = iter(decoded)
                    self._live = (chunk, partial(consumed, lo + len(run), records))
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
                    self._unread = None
                else:
                    live = self._live_cursor()
                    if live is not None:
                        self._cursors[topo.reader] = live
                    if tally is not None:
                        self._audit_live(tally, leave=True)
                self._live = None
                self._token = None

    def _one_by_one(
        self, chunk: Chunk, lo: int, run: list[Any], decode: Callable[[Any], Any]
    ) -> Iterator[tuple[Any]]:
        """``run`` (raws ``lo...`` of ``chunk``, one of them bad) decoded one record at a time: every record
        before a bad one is handed out, then the bad one is reported (raise, or skip and count)."""
        records = iter(run)
        self._live = (chunk, partial(consumed, lo + len(run), records))
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
            readers = topo.world_size * self.loader_workers if self.loader_workers else topo.readers
            with contextlib.suppress(DataError):  # it cannot move: saved as loaded, iterating says why
                self.reshare(topo.world_size, readers)
        cursors = dict(self._cursors)
        live = self._live_cursor()
        if live is not None:
            cursors[topo.reader] = live
        saved = {str(reader): cursor.to_dict() for reader, cursor in sorted(cursors.items())}
        self._checkpointed = True
        if self._tallies:
            self._audit_state(saved, topo.reader)
        return {
            **self._source.state_fields(),  # a table's read session, to read the same streams on resume
            "version": STATE_VERSION,
            "epoch": self._epoch,
            "fingerprint": self.fingerprint(),
            "options": self._options(),
            "readers": self._readers if cursors else None,
            "world_size": (self._saved_world or topo.world_size) if cursors else None,
            "elastic": self._elastic(),
            "plan": self._unread,
            "covers": sorted(self._held | {topo.reader}),
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
                f"({mismatch(state.get('options'), self._options())}): "
                "open the dataset exactly as when the state was saved, or start the epoch afresh without "
                "this state"
            )
        record = self._source.checked(state)  # checked before anything changes (a table's read session)
        self._epoch, self._cursors, self._readers, self._saved_world, self._held, self._unread = (
            checked_state(state)
        )
        self._tallies = saved_tallies(state, self._epoch) if audit.active() else {}
        self._checkpointed = True
        self._live = None
        self._token = None
        self._source.load(record, self._epoch, bool(self._cursors), self._equalize_mode() is not None)

    def reshare(self, world_size: int, readers: int) -> None:
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
        missing = sorted(set(range(old)) - self._held)
        if missing:
            raise DataError(
                f"{where}, but the state holds the positions of readers {sorted(self._held)} only (missing "
                f"{missing[:8]}): pass the states of every rank merged by "
                "vertexrt.data.merge_states([...]) (gather them with "
                "torch.distributed.all_gather_object when saving)"
            )
        order = self._order(old)
        plan = within(self._unread, sum(self._source.counts(order, self._context(), shared=False)))
        consumed = {}
        for reader in range(old):
            cursor = self._cursors.get(reader, Cursor())
            full = sum(end - start for start, end in share(plan, reader, old))
            consumed[reader] = cursor.consumed if cursor.phase == OWN else full
        self._unread = remaining(plan, old, consumed)
        logger.info(
            "%s: %d records of the epoch left, shared out afresh", where, sum(b - a for a, b in self._unread)
        )
        self._cursors = {}
        self._held = set()
        self._readers = None
        self._saved_world = None
        self._tallies = {}  # the readers' tallies do not map onto new readers: the audit restarts

    def _elastic(self) -> bool:
        """True when this dataset's state can resume on another topology (contiguous shares, no buffer)."""
        return self._elastic_at(self.topology().world_size)

    def _elastic_at(self, world_size: int) -> bool:
        if self.block_size > 1 or not self._source.elastic:
            return False
        return self._unread is not None or self._equalize_mode(world_size) is not None

    def fingerprint(self) -> str:
        """A short hash of what the cursor's meaning depends on (data files, format, options)."""
        if self._fingerprint is None:
            self._fingerprint = fingerprint(self._source.identity(), self._options(), self.columnar)
        return self._fingerprint

    def _options(self) -> dict[str, Any]:
        """What the cursor's meaning depends on, by option name (small: saved in every state)."""
        files, versions = self._source.summary()
        return {
            "files": files,
            "versions": versions,
            "format": short_format(self.format),
            "shuffle": self.shuffle,
            "seed": self.seed,
            "shuffle_buffer": self.block_size,
            "equalize": self.equalize,
            "batch_size": self.batch_size,
            "columnar": self.columnar,
        }

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

    def prepare(self, num_workers: int | None = None) -> None:
        """Do the work every reader shares once, before forking DataLoader workers: plan a table's Storage
        Read streams (one session, created by the chief and shared with every rank; at an epoch start, a
        new one when it has less than an hour left), count the records of every unit for ``equalize``.
        ``num_workers``: the DataLoader workers per rank that will read it (their units are planned).
        Iterating does it on first use too.

        Example:
            >>> ds = open_dataset("bq://p.d.t"); ds.prepare()   # every rank, like a collective
        """
        with self._as_workers(num_workers):
            context = self._context()
            self._source.prepare(context)
            readers = context.readers
            if self._equalize_mode() is not None or self._source.contiguous(context, self._unread, readers):
                counted(self._source, self._order(readers), self._context())

    def read_plan(self) -> dict[str, Any] | None:
        """How this process reads the data, for DataLoader workers (a ``bq://`` table's planned read session
        and its stream row counts), or None: nothing to hand over (files)."""
        return self._source.plan_record()

    def use_read_plan(self, plan: dict[str, Any] | None) -> None:
        """Read as ``plan`` (a checked :meth:`read_plan` of the DataLoader's parent) says, while it lives."""
        self._source.follow(plan)

    def copy_at_epoch_start(self) -> Dataset:
        """A copy at the start of the current epoch (no position loaded, no read-ahead) that shares what is
        counted; e.g. to look at a first record without moving this dataset."""
        probe = copy.copy(self)
        probe.__dict__ = self.__getstate__()
        probe._source = copy.copy(self._source)  # planned here alone; what it counts is kept for both
        probe._cursors = {}
        probe.prefetch = 0
        return probe

    # -- internals ----------------------------------------------------------------------------------
    @contextlib.contextmanager
    def _as_workers(self, num_workers: int | None) -> Iterator[None]:
        """Plan as reader 0 of ``num_workers`` DataLoader workers of this rank (None: as this process is)."""
        if num_workers is None:
            yield
            return
        saved, self._worker = self._worker, (0, max(1, num_workers))
        try:
            yield
        finally:
            self._worker = saved

    def _context(self, topo: Topology | None = None) -> PlanContext:
        return PlanContext(
            topology=topo or self.topology(),
            readers=self._planned_readers(),
            epoch=self._epoch,
            mid_epoch=bool(self._cursors),
            equalizing=self._equalize_mode() is not None,
            in_loader_worker=_in_loader_worker(),
        )

    def _planned_readers(self) -> int:
        """The readers of this job: replicas x the DataLoader workers of each (as set by the loader)."""
        topo = self.topology()
        return topo.world_size * (topo.num_workers if self._worker else self.loader_workers or 1)

    def _order(self, readers: int) -> list[Unit]:
        return epoch_units(self._source, self._context(), readers, self.seed, self.shuffle)

    def _equalize_mode(self, world_size: int | None = None) -> str | None:
        """The equalize mode in force: ``"auto"`` is ``"drop_remainder"`` with several replicas, else none."""
        if self.equalize == "auto":
            world = self.topology().world_size if world_size is None else world_size
            return "drop_remainder" if world > 1 else None
        return self.equalize

    def _spec(self, topo: Topology) -> StreamSpec:
        order = self._order(topo.readers)
        options = ReadOptions(
            self.format, self._equalize_mode(), self.batch_size, self.block_size, self.seed, self.columnar
        )
        return reader_spec(self._source, self._context(topo), order, self._unread, options)

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
        names = self._source.names()
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
            source=next(iter(self._source.names()), ""),
            epoch=self._epoch,
            reader=self.topology().reader,
            readers=self._readers or self.topology().readers,
            count=tally.count,
            digest=f"{tally.digest:016x}",
            finished=finished,
            read=tally.read,
        )

    def __repr__(self) -> str:
        what = self._source.title()
        return f"Dataset({what}, format={self.format!r}, shuffle={self.shuffle}, seed={self.seed})"


def _in_loader_worker() -> bool:
    """True inside a torch DataLoader worker process."""
    import sys

    data = sys.modules.get("torch.utils.data")
    return data is not None and data.get_worker_info() is not None


def _default_prefetch(sources: Sequence[FileSource] | TableSource) -> int:
    from vertexrt.paths import storage_kind

    if isinstance(sources, TableSource) or any(storage_kind(s.uri) != "local" for s in sources):
        return 2
    return 0

"""torch adapters: an ``IterableDataset`` that shards across DataLoader workers (``set_epoch``, and the
``bq://`` read session it renewed, reach persistent workers through shared memory), and a ``DataLoader``
whose ``state_dict()`` is exact with any ``num_workers``.

Each DataLoader worker is its own reader (``rank * num_workers + worker``). The :class:`DataLoader` here
has every worker attach its O(1) cursor to each batch it collates; the loader keeps the cursor of the
last batch it handed out from each worker, so its state names exactly the next unseen record of every
worker, however far the workers have read ahead.

Example:
    >>> loader = vertexrt.data.torch.DataLoader(open_dataset("gs://b/train-*.jsonl"), batch_size=32,
    ...                                         num_workers=2, persistent_workers=True)
    >>> loader.load_state_dict(checkpoint["data"])       # before iterating
    >>> for epoch in range(start_epoch, 10):
    ...     loader.set_epoch(epoch)
    ...     for batch in loader:
    ...         ...; checkpoint["data"] = loader.state_dict()
"""

from __future__ import annotations

import copy
import itertools
import json
import logging
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch
import torch.utils.data
from torch.utils.data import IterableDataset, get_worker_info

from vertexrt.data.cursor import DONE, Cursor
from vertexrt.errors import ConfigError, DataError
from vertexrt.phases import long_phase

if TYPE_CHECKING:
    from vertexrt.data.dataset import Dataset

logger = logging.getLogger(__name__)


class TorchIterable(IterableDataset):  # type: ignore[type-arg]
    """A vertexrt :class:`~vertexrt.data.dataset.Dataset` as a torch IterableDataset.

    Args:
        num_workers: the DataLoader workers that will read it (0: none); the record counts for
            ``equalize`` are made here, once, for the pieces those workers read (see :meth:`prepare`).
    """

    def __init__(self, dataset: Dataset, num_workers: int = 0):
        super().__init__()
        dataset.topology()  # resolve rank / world size here, in the parent, where torch.distributed is set up
        self.dataset = dataset
        self.prepare(num_workers)
        # [requested epoch, generation, plan generation]: written by set_epoch in the parent, read by
        # (persistent) workers.
        self._shared = torch.tensor([dataset.epoch, 0, 0], dtype=torch.int64).share_memory_()
        self._seen = 0
        self._plans = _SharedReadPlan(dataset)
        self._plan_seen = 0

    def prepare(self, num_workers: int) -> None:
        """Do the shared work (``equalize`` record counts) here, for ``num_workers`` DataLoader workers per
        rank, before they start: each worker starts with a copy of the counts instead of counting again.
        :class:`DataLoader` calls it; call it yourself before a plain torch DataLoader with workers.

        Example:
            >>> it = ds.as_torch(); it.prepare(num_workers=4)
            >>> loader = torch.utils.data.DataLoader(it, batch_size=32, num_workers=4)
        """
        self.dataset.prepare(num_workers)  # the readers are this rank's workers (their pieces)

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch in this process and in every (persistent) DataLoader worker; a ``bq://`` read
        session renewed here (less than an hour left) is handed to the workers, which read it from then on."""
        self.dataset.set_epoch(epoch)  # a bq:// session about to expire is renewed here
        if self._plans.publish(self.dataset):
            self._shared[2] += 1
            self._plan_seen = int(self._shared[2])  # workers forked from here on have it already
        self._shared[0] = int(epoch)
        self._shared[1] += 1

    def __iter__(self) -> Iterator[Any]:
        info = get_worker_info()
        dataset = self.dataset
        if info is not None:
            dataset.set_loader_worker(info.id, info.num_workers)
        plans = int(self._shared[2])
        if info is not None and plans != self._plan_seen:  # the parent renewed its read session
            self._plan_seen = plans
            self._plans.apply(dataset)
        generation = int(self._shared[1])
        if generation != self._seen:
            self._seen = generation
            dataset.set_epoch(int(self._shared[0]))
        if dataset.columnar:  # numpy dicts that torch takes (columns.tensor_ready); the loader makes tensors
            from vertexrt.data.columns import numpy_batch, tensor_ready

            batches = map(numpy_batch, iter(dataset)) if dataset.arrow else iter(dataset)
            return ({name: tensor_ready(column) for name, column in batch.items()} for batch in batches)
        return iter(dataset)

    def state_dict(self) -> dict[str, Any]:
        """This process's (or, called inside a worker, this worker's) reader state."""
        return self.dataset.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Load a state before the DataLoader starts its workers (they copy the dataset when they start)."""
        self.dataset.load_state_dict(copy.deepcopy(state))

    def __len__(self) -> int:
        raise TypeError("a streaming vertexrt dataset has no len(); use equalize=... for equal batch counts")


class _SharedReadPlan:
    """A ``bq://`` dataset's read plan (session, stream names, stream row counts: ``Dataset.read_plan()``)
    in shared memory, so that persistent DataLoader workers read the session the parent renewed instead of
    each making one of its own when their forked copy expires."""

    def __init__(self, dataset: Dataset):
        plan = dataset.read_plan()
        self.session = plan["name"] if plan else None
        blob = None if plan is None else json.dumps(plan).encode()
        # a new session of the same table and options has about as many streams, with names as long
        self.buffer = torch.zeros(0 if blob is None else max(1 << 16, 4 * len(blob)), dtype=torch.uint8)
        self.buffer.share_memory_()

    def publish(self, dataset: Dataset) -> bool:
        """Write the parent's plan when its session changed; True when written."""
        plan = dataset.read_plan()
        session = plan["name"] if plan else None
        if plan is None or session == self.session:
            return False
        self.session = session
        blob = json.dumps(plan).encode()
        if len(blob) + 8 > len(self.buffer):
            logger.warning(
                "bq://%s: the renewed read session %s does not fit the %d bytes shared with persistent "
                "DataLoader workers; each worker makes its own session when its copy expires",
                plan.get("table"),
                session,
                len(self.buffer),
            )
            return False
        self.buffer[:8] = torch.tensor(list(len(blob).to_bytes(8, "little")), dtype=torch.uint8)
        self.buffer[8 : 8 + len(blob)] = torch.frombuffer(bytearray(blob), dtype=torch.uint8)
        return True

    def apply(self, dataset: Dataset) -> None:
        """In a worker: read the streams (and their row counts) of the plan last published."""
        from vertexrt.data.bigquery_session import check_record

        size = int.from_bytes(bytes(self.buffer[:8].tolist()), "little")
        dataset.use_read_plan(check_record(json.loads(bytes(self.buffer[8 : 8 + size].numpy()).decode())))


def collate_rows(samples: list[Any]) -> Any:
    """torch's ``default_collate`` for records (dicts) of JSONL, CSV, Parquet or BigQuery rows: numbers as
    tensors, a column of strings (or bytes) as a list, as before; a timestamp / DATETIME column as int64
    microseconds since 1970-01-01 UTC, DATE as days, TIME as microseconds since midnight, NUMERIC as float
    (the values ``columnar=True`` gives); a missing value (None, an absent key) in any other column raises a
    :class:`~vertexrt.errors.DataError` naming the column, instead of a TypeError from inside the loader.
    :class:`DataLoader` uses it unless given ``collate_fn``; pass it to a plain torch DataLoader yourself.

    Example:
        >>> loader = torch.utils.data.DataLoader(ds.as_torch(), batch_size=32, collate_fn=collate_rows)
    """
    from torch.utils.data import default_collate

    from vertexrt.data.row_values import tensor_value

    if not samples or not isinstance(samples[0], dict):
        return default_collate(samples)
    batch: dict[str, Any] = {}
    for column in samples[0]:
        values = [sample.get(column) for sample in samples]
        present = [v for v in values if v is not None]
        if present and all(isinstance(v, str | bytes) for v in present):  # text: a list, None kept
            batch[column] = values
            continue
        ready = [tensor_value(v, column, row) for row, v in enumerate(values)]
        try:
            batch[column] = default_collate(ready)
        except (TypeError, RuntimeError) as err:
            raise DataError(
                f"column {column!r} cannot be batched into a tensor ({err}); convert it in the data, or "
                "pass collate_fn=... to the DataLoader"
            ) from err
    return batch


class _CursorCollate:
    """Runs where the batch is collated (the worker): ``(reader, epoch, cursor, collate(samples))``."""

    def __init__(self, collate: Callable[[list[Any]], Any], dataset: TorchIterable):
        self.collate = collate
        self.dataset = dataset

    def __call__(self, samples: list[Any]) -> tuple[int, int, dict[str, Any] | None, Any]:
        info = get_worker_info()
        data = (info.dataset if info is not None else self.dataset).dataset  # type: ignore[union-attr,attr-defined]
        reader = data.topology().reader
        state = data.state_dict()
        return reader, state["epoch"], state["cursors"].get(str(reader)), self.collate(samples)


class DataLoader(torch.utils.data.DataLoader):  # type: ignore[type-arg]
    """``torch.utils.data.DataLoader`` over a vertexrt dataset, with an exact ``state_dict()``.

    Takes a :class:`~vertexrt.data.dataset.Dataset` (or its ``as_torch()``) and the usual DataLoader
    arguments (``batch_size``, ``num_workers``, ``persistent_workers``, ``collate_fn``, ...); over a
    ``columnar`` dataset each batch is the reader's column batch as tensors (``batch_size=None``); records
    are batched by :func:`collate_rows` unless ``collate_fn`` is given. Call
    ``load_state_dict`` before the first iteration. A state resumes on another world size or ``num_workers``
    when its layout is elastic (``shuffle_buffer=1`` with ``equalize`` in force) and it holds every rank's
    readers (:func:`~vertexrt.data.merge_states`).
    """

    def __init__(self, dataset: Dataset | TorchIterable, collate_fn: Any = None, **kwargs: Any):
        from torch.utils.data import default_convert

        workers = kwargs.get("num_workers", 0)
        if isinstance(dataset, TorchIterable):
            iterable = dataset
            iterable.prepare(workers)  # it may have been made for another number of workers
        else:
            iterable = TorchIterable(dataset, workers)
        if iterable.dataset.columnar:  # the reader's batches are the loader's batches: no per-row collate
            kwargs.setdefault("batch_size", None)
        default = default_convert if kwargs.get("batch_size", 1) is None else collate_rows
        super().__init__(iterable, collate_fn=_CursorCollate(collate_fn or default, iterable), **kwargs)
        self._reader_cursors: dict[int, dict[str, Any]] = {}
        self._cursors_epoch = iterable.dataset.epoch
        self._resumed_epoch: int | None = None  # the epoch a loaded state is in the middle of
        self._resumed_batches: int | None = None  # the batches of it handed out before the save
        self._handed: int | None = 0  # batches of the current epoch handed out (None: unknown)
        iterable.dataset.loader_workers = max(1, self.num_workers)

    @property
    def data(self) -> Dataset:
        """The vertexrt dataset."""
        return self.dataset.dataset  # type: ignore[attr-defined,no-any-return]

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch (it reaches persistent workers)."""
        self.dataset.set_epoch(epoch)  # type: ignore[attr-defined]

    def __len__(self) -> int:
        """Batches per epoch on this rank when every reader yields a known number of records (``equalize``
        in force, see ``Dataset.epoch_length``). A loop that knows it does not read ahead to find the
        epoch's end (Lightning), so the saved position is that of the last batch trained on.

        Raises:
            TypeError: the dataset is not equalized (its epoch length is unknown until read).
        """
        data = self.data
        workers = max(1, self.num_workers)
        records = data.epoch_length(workers)  # every reader of this rank (one per worker) yields as many
        if records is None:
            raise TypeError(
                "this vertexrt.data.DataLoader has no len(): its dataset is not equalized; open it with "
                "equalize='drop_remainder' for a known number of batches per epoch"
            )
        if self.batch_size is None:  # a columnar reader's batches, or records one by one
            return records * workers
        per_worker = records // self.batch_size if self.drop_last else -(-records // self.batch_size)
        return per_worker * workers

    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]
        data = self.data
        epoch = data.epoch
        if epoch != self._cursors_epoch:
            self._reader_cursors = {}
            self._cursors_epoch = epoch
        # From an epoch's start with a known len(), the last batch ends the epoch at once: a loop that knows
        # len() (Lightning) never asks past it, and its saved state is then the next epoch's start.
        resumed = self._resumed_epoch == epoch
        self._handed = self._resumed_batches if resumed else 0
        last = None if resumed and self._handed is None else _length_of(self)
        with long_phase("DataLoader start-up"):  # workers start and fill their first batch: not a hang
            batches = super().__iter__()
            first = list(itertools.islice(batches, 1))
        for reader, reader_epoch, cursor, batch in itertools.chain(first, batches):
            if reader_epoch > epoch:  # this batch ended that reader's epoch
                self._reader_cursors[reader] = Cursor(phase=DONE).to_dict()
            elif cursor is not None:
                self._reader_cursors[reader] = cursor
            if self._handed is not None:
                self._handed += 1
            if last is not None and self._handed == last:
                self.set_epoch(epoch + 1)
                yield batch
                return
            yield batch
        if data.epoch == epoch:  # an exhausted epoch moves on, as iterating a Dataset does
            self.set_epoch(epoch + 1)

    def state_dict(self) -> dict[str, Any]:
        """The position after the last batch handed out, for every reader, and how many batches of the epoch
        this rank handed out (JSON-serializable, small)."""
        state = self.data.state_dict()
        if self.data.epoch != self._cursors_epoch:
            return state
        cursors = dict(state["cursors"])
        cursors.update({str(reader): cursor for reader, cursor in self._reader_cursors.items()})
        topo = self.data.topology()
        workers = max(1, self.num_workers)
        readers = topo.world_size * workers
        covers = self.data.readers_in_state | set(range(topo.rank * workers, (topo.rank + 1) * workers))
        return {
            **state,
            "readers": readers if cursors else None,
            "world_size": topo.world_size if cursors else None,
            "covers": sorted(covers),
            "cursors": dict(sorted(cursors.items())),
            "batches": self._handed,  # this rank's, for a loop that counts batches against len()
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state``; call it before iterating (workers copy the dataset when they start)."""
        if getattr(self, "_iterator", None) is not None:
            raise ConfigError(
                "DataLoader.load_state_dict() after its persistent workers started: load the state right "
                "after creating the loader, before the first iteration"
            )
        self.dataset.load_state_dict(state)  # type: ignore[attr-defined]
        world = self.data.topology().world_size
        self.data.reshare(world, world * max(1, self.num_workers))  # another world size: share out afresh
        self._reader_cursors = {}
        self._cursors_epoch = self.data.epoch
        self._resumed_epoch = self.data.epoch
        batches = state.get("batches")  # counted in the saved layout: valid only in the same one
        readers = world * max(1, self.num_workers)
        same = state.get("readers") in (None, readers) and state.get("world_size") in (None, world)
        self._resumed_batches = batches if same and isinstance(batches, int) and batches >= 0 else None


def _length_of(loader: DataLoader) -> int | None:
    try:
        return len(loader)
    except TypeError:
        return None

"""torch adapters: an ``IterableDataset`` that shards across DataLoader workers (``set_epoch`` reaches
persistent workers through shared memory), and a ``DataLoader`` whose ``state_dict()`` is exact with any
``num_workers``.

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
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch
import torch.utils.data
from torch.utils.data import IterableDataset, get_worker_info

from vertexrt.data.cursor import DONE, Cursor
from vertexrt.errors import ConfigError

if TYPE_CHECKING:
    from vertexrt.data.dataset import Dataset


class TorchIterable(IterableDataset):  # type: ignore[type-arg]
    """A vertexrt :class:`~vertexrt.data.dataset.Dataset` as a torch IterableDataset."""

    def __init__(self, dataset: Dataset):
        super().__init__()
        dataset.topology()  # resolve rank / world size here, in the parent, where torch.distributed is set up
        dataset.prepare()
        self.dataset = dataset
        # [requested epoch, generation]: written by set_epoch in the parent, read by (persistent) workers.
        self._shared = torch.tensor([dataset.epoch, 0], dtype=torch.int64).share_memory_()
        self._seen = 0

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch in this process and in every (persistent) DataLoader worker."""
        self.dataset.set_epoch(epoch)
        self._shared[0] = int(epoch)
        self._shared[1] += 1

    def __iter__(self) -> Iterator[Any]:
        info = get_worker_info()
        dataset = self.dataset
        if info is not None:
            dataset._worker = (info.id, info.num_workers)
        generation = int(self._shared[1])
        if generation != self._seen:
            self._seen = generation
            dataset.set_epoch(int(self._shared[0]))
        return iter(dataset)

    def state_dict(self) -> dict[str, Any]:
        """This process's (or, called inside a worker, this worker's) reader state."""
        return self.dataset.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Load a state before the DataLoader starts its workers (they copy the dataset when they start)."""
        self.dataset.load_state_dict(copy.deepcopy(state))

    def __len__(self) -> int:
        raise TypeError("a streaming vertexrt dataset has no len(); use equalize=... for equal batch counts")


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
    arguments (``batch_size``, ``num_workers``, ``persistent_workers``, ``collate_fn``, ...). Call
    ``load_state_dict`` before the first iteration; resume with the same world size and ``num_workers``
    (or from an epoch start, with any).
    """

    def __init__(self, dataset: Dataset | TorchIterable, collate_fn: Any = None, **kwargs: Any):
        from torch.utils.data import default_collate

        iterable = dataset if isinstance(dataset, TorchIterable) else dataset.as_torch()
        super().__init__(
            iterable, collate_fn=_CursorCollate(collate_fn or default_collate, iterable), **kwargs
        )
        self._reader_cursors: dict[int, dict[str, Any]] = {}
        self._cursors_epoch = iterable.dataset.epoch

    @property
    def data(self) -> Dataset:
        """The vertexrt dataset."""
        return self.dataset.dataset  # type: ignore[attr-defined,no-any-return]

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch (it reaches persistent workers)."""
        self.dataset.set_epoch(epoch)  # type: ignore[attr-defined]

    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]
        data = self.data
        epoch = data.epoch
        if epoch != self._cursors_epoch:
            self._reader_cursors = {}
            self._cursors_epoch = epoch
        for reader, reader_epoch, cursor, batch in super().__iter__():
            if reader_epoch > epoch:  # this batch ended that reader's epoch
                self._reader_cursors[reader] = Cursor(phase=DONE).to_dict()
            elif cursor is not None:
                self._reader_cursors[reader] = cursor
            yield batch
        if data.epoch == epoch:  # an exhausted epoch moves on, as iterating a Dataset does
            self.set_epoch(epoch + 1)

    def state_dict(self) -> dict[str, Any]:
        """The position after the last batch handed out, for every reader (JSON-serializable, small)."""
        state = self.data.state_dict()
        if self.data.epoch != self._cursors_epoch:
            return state
        cursors = dict(state["cursors"])
        cursors.update({str(reader): cursor for reader, cursor in self._reader_cursors.items()})
        topo = self.data.topology()
        readers = topo.world_size * max(1, self.num_workers)
        return {**state, "readers": readers if cursors else None, "cursors": dict(sorted(cursors.items()))}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state``; call it before iterating (workers copy the dataset when they start)."""
        if getattr(self, "_iterator", None) is not None:
            raise ConfigError(
                "DataLoader.load_state_dict() after its persistent workers started: load the state right "
                "after creating the loader, before the first iteration"
            )
        self.dataset.load_state_dict(state)  # type: ignore[attr-defined]
        self._reader_cursors = {}
        self._cursors_epoch = self.data.epoch

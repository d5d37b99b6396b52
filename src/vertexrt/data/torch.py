"""``torch.utils.data.IterableDataset`` adapter: shards across DataLoader workers, and ``set_epoch`` reaches
persistent workers through shared memory.

Each DataLoader worker is its own reader (``rank * num_workers + worker``), so with ``num_workers > 0``
batches come from one worker at a time. ``state_dict()`` / ``load_state_dict()`` follow the protocol of
torchdata's ``StatefulDataLoader`` (called inside each worker); without workers they are the dataset's.

Example:
    >>> ds = open_dataset("gs://b/train-*.tfrecord").as_torch()
    >>> loader = DataLoader(ds, batch_size=32, num_workers=2, persistent_workers=True)
    >>> for epoch in range(3):
    ...     ds.set_epoch(epoch)
    ...     for batch in loader: ...
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch.utils.data import IterableDataset, get_worker_info

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
        """This process's (or this worker's) reader state."""
        return self.dataset.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Load a state before creating the DataLoader iterator (workers copy the dataset when they start)."""
        self.dataset.load_state_dict(copy.deepcopy(state))

    def __len__(self) -> int:
        raise TypeError("a streaming vertexrt dataset has no len(); use equalize=... for equal batch counts")

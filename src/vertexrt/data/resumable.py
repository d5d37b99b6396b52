"""Map-style datasets that resume exactly: torchdata's ``StatefulDataLoader`` over a ``ResumableSampler``.

:func:`resumable_loader` is the one entry point. Its state (``state_dict()``) names the epoch and the
position in it; ``vertexrt.Trainer`` saves it with each checkpoint, Lightning's fit loop saves it (the
loader is stateful and sized, so Lightning does not read ahead), and a resume continues at the next unseen
batch, with any ``num_workers``.

Why not torchdata's ``StatefulDistributedSampler`` alone: its state is a position without an epoch, so a
state saved on an epoch's last batch makes the *next* epoch empty (the position is applied to whatever epoch
comes next), and the position is only consumed when iteration starts. :class:`ResumableSampler` keeps the
epoch with the position and applies it to that epoch only.

XX
Lightning and Hugging Face callbacks log it as a warning).

Example:
    >>> loader = vertexrt.data.resumable_loader(dataset, batch_size=32, shuffle=True, seed=0)
    >>> trainer.fit(model, loader, ckpt_path=vertex.ckpt_path())     # Lightning: nothing else to do
"""

from __future__ import annotations

from collections.abc import Iterator, Sized
from typing import Any

import torch.utils.data
from torchdata.stateful_dataloader import StatefulDataLoader

from vertexrt.data.sharding import replica
from vertexrt.errors import ConfigError

__all__ = ["ResumableLoader", "ResumableSampler", "resumable_loader"]


class ResumableSampler(torch.utils.data.DistributedSampler):  # type: ignore[type-arg]
    """``DistributedSampler`` (this rank's share, reshuffled from ``seed + epoch``) with a state:
    ``{"epoch", "yielded"}``. A loaded state applies to its epoch only: iterating that epoch continues after
    ``yielded`` indices; another epoch (``set_epoch`` after the load) starts at its beginning.
    :class:`ResumableLoader` selects the saved epoch when its state is loaded.

    Rank and world size are vertexrt's (``torch.distributed`` when initialised, else the cluster), so the
    sampler can be made before Lightning or the Trainer joins the process group.
    """

    def __init__(
        self,
        dataset: Sized,
        *,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
        rank: int | None = None,
        world_size: int | None = None,
    ) -> None:
        rank, world_size = replica(rank, world_size)
        super().__init__(
            dataset,  # type: ignore[arg-type]
            num_replicas=world_size,
            rank=rank,
            shuffle=shuffle,
            seed=seed,
            drop_last=drop_last,
        )
        self.yielded = 0
        self.started_epoch: int | None = None  # the epoch whose indices were handed out last
        self._resume: tuple[int, int] | None = None

    def set_epoch(self, epoch: int) -> None:
        if epoch != self.epoch:
            self.yielded = 0
        super().set_epoch(epoch)

    def __iter__(self) -> Iterator[int]:
        return _Counted(self)

    def _start(self) -> list[int]:
        """This epoch's indices from the resume position (consumed), at the first index asked for."""
        indices = list(super().__iter__())
        self.started_epoch = self.epoch
        start = 0
        if self._resume is not None:
            epoch, yielded = self._resume
            self._resume = None
            start = min(yielded, len(indices)) if epoch == self.epoch else 0
        self.yielded = start
        return indices[start:]

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "yielded": self.yielded}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        epoch, yielded = state.get("epoch"), state.get("yielded")
        if not isinstance(epoch, int) or not isinstance(yielded, int) or epoch < 0 or yielded < 0:
            raise ConfigError(
                f"ResumableSampler.load_state_dict: state {state!r} is not one this sampler saved "
                "(expected non-negative ints 'epoch' and 'yielded'); pass the loader's own state_dict()"
            )
        self.yielded = yielded if epoch == self.epoch else 0
        self._resume = (epoch, yielded)


class _Counted(Iterator[int]):
    """An epoch's indices, counting each one handed out into the sampler's ``yielded``. The epoch and the
    resume position are read at the first ``next()``: Lightning creates the loader's iterator before its
    ``set_epoch`` for the epoch that iterator serves."""

    def __init__(self, sampler: ResumableSampler) -> None:
        self.sampler = sampler
        self.indices: Iterator[int] | None = None

    def __next__(self) -> int:
        if self.indices is None:
            self.indices = iter(self.sampler._start())
        index = next(self.indices)
        self.sampler.yielded += 1
        return index


class ResumableLoader(StatefulDataLoader):  # type: ignore[misc]
    """torchdata's ``StatefulDataLoader`` whose state carries its sampler's epoch: loading a state selects
    that epoch at once, so a loop that does not call ``set_epoch`` mid-epoch (``vertexrt.Trainer``) continues
    the saved one, and a state saved on an epoch's last batch resumes at the next epoch's start instead of an
    empty epoch. Made by :func:`resumable_loader`."""

    def state_dict(self) -> dict[str, Any]:
        """``{"epoch", "loader"}``; once every batch of the epoch was handed out, the start of the next epoch
        (a loop restoring it knows the epoch ended: Lightning creates, and with workers fills, the resumed
        iterator before it calls ``set_epoch``)."""
        epoch = int(getattr(self.sampler, "epoch", 0))
        # torch's DataLoader iterators count the batches they handed out in `_num_yielded`
        ended = getattr(self.sampler, "started_epoch", None)
        if ended is not None and 0 < len(self) <= getattr(self._iterator, "_num_yielded", 0):
            return {"epoch": ended + 1, "loader": {}}  # also when the loop already called set_epoch(next)
        return {"epoch": epoch, "loader": super().state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if not isinstance(state, dict) or not isinstance(state.get("epoch"), int) or "loader" not in state:
            raise ConfigError(
                f"ResumableLoader.load_state_dict: {type(state).__name__} is not a state this loader saved "
                "(expected {'epoch': int, 'loader': ...}); pass the loader's own state_dict()"
            )
        set_epoch = getattr(self.sampler, "set_epoch", None)
        if callable(set_epoch):
            set_epoch(state["epoch"])
        super().load_state_dict(state["loader"])


def resumable_loader(
    dataset: Any,
    batch_size: int = 1,
    *,
    shuffle: bool = True,
    seed: int = 0,
    drop_last: bool = False,
    rank: int | None = None,
    world_size: int | None = None,
    **loader_options: Any,
) -> ResumableLoader:
    """A :class:`ResumableLoader` (torchdata's ``StatefulDataLoader``) over this rank's share of a map-style
    ``dataset`` (``len`` and ``__getitem__``), reshuffled each epoch from ``seed + epoch``, whose
    ``state_dict()`` resumes at the next unseen batch.

    Every rank gets the same number of batches: with ``drop_last`` the records that do not fill a share or a
    batch are dropped, else the shares are padded by repeating records (as ``DistributedSampler`` does).
    ``loader_options`` are ``StatefulDataLoader``'s (``num_workers``, ``collate_fn``, ``pin_memory``, ...).
    The epoch comes from the training loop: Lightning, ``vertexrt.Trainer`` and the HF Trainer call
    ``loader.sampler.set_epoch``; a loop of your own calls it at each epoch's start.

    Raises:
        ConfigError: ``sampler`` / ``batch_sampler`` / a true ``shuffle``
            is also passed in ``loader_options``.

    Example:
        >>> loader = resumable_loader(dataset, batch_size=32, num_workers=2, seed=0)
        >>> loader.load_state_dict(saved)        # then iterate: the rest of the saved epoch
    """
    clash = sorted({"sampler", "batch_sampler", "shuffle"} & set(loader_options))
    if clash:
        raise ConfigError(
            f"resumable_loader(..., {', '.join(clash)}=...): the loader's sampler is vertexrt's "
            "ResumableSampler; pass shuffle= and seed= to resumable_loader itself"
        )
    sampler = ResumableSampler(
        dataset, shuffle=shuffle, seed=seed, drop_last=drop_last, rank=rank, world_size=world_size
    )
    return ResumableLoader(
        dataset, batch_size=batch_size, sampler=sampler, drop_last=drop_last, **loader_options
    )

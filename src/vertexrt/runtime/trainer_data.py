"""How the Trainer reads ``train_data``: epochs, batches per epoch, the read position, batch sizes.

``train_data`` is any iterable of batches: a vertexrt reader, a torch DataLoader, a list. These helpers ask
it what it knows (``len``, ``set_epoch``, ``state_dict``) and fall back quietly when it knows nothing.
"""

from __future__ import annotations

import itertools
import types
from collections.abc import Iterable, Iterator, Mapping
from typing import Any, TypeVar

from vertexrt.errors import ConfigError
from vertexrt.runtime.state import as_stateful

T = TypeVar("T")


def iterate(data: Iterable[T], *, keep_rng: bool) -> Iterator[T]:
    """``iter(data)``; with ``keep_rng``, starting it leaves the global RNGs where they are.

    A torch DataLoader draws a seed from torch's generator when its iterator starts. Resuming mid-epoch,
    the original run drew it at the epoch start, before the restored RNG state: drawing it again would
    shift every later random number. A generator-based loader draws it at its first batch, so that batch
    is fetched before the RNG state is put back.
    """
    if not keep_rng:
        return iter(data)
    from vertexrt.checkpoint import rng_state

    rng = rng_state()
    before = rng.state_dict()
    batches = iter(data)
    lazy = isinstance(batches, types.GeneratorType)
    started = list(itertools.islice(batches, 1)) if lazy else []
    rng.load_state_dict(before)
    return itertools.chain(started, batches) if lazy else batches


def batches_per_epoch(data: Any) -> int | None:
    """Batches per epoch when ``data`` knows it (``len``), else None (e.g. a streaming reader)."""
    try:
        return len(data)
    except (TypeError, NotImplementedError):
        return None


def set_epoch(data: Any, epoch: int) -> None:
    """Call ``set_epoch`` on the data, or on a DataLoader's dataset / sampler."""
    for target in (data, getattr(data, "dataset", None), getattr(data, "sampler", None)):
        method = getattr(target, "set_epoch", None)
        if callable(method):
            method(epoch)
            return


def read_position_of(data: Any) -> Any:
    """What holds the read position of ``data``: itself, a DataLoader's dataset, or None.

    A DataLoader with worker processes reads in the workers: its dataset's position in this process never
    moves, so it counts as none (resuming then replays the epoch's order and skips what was seen).
    """
    if as_stateful(data) is not None:
        return data
    dataset = getattr(data, "dataset", None)
    workers = int(getattr(data, "num_workers", 0) or 0)
    return None if dataset is None or workers > 0 or as_stateful(dataset) is None else dataset


def check_equalized(data: Any, world_size: int, owner: str) -> None:
    """With several replicas every rank must yield the same number of batches, or a collective hangs."""
    if world_size == 1:
        return
    for reader in (data, getattr(data, "dataset", None)):
        if reader is not None and not getattr(reader, "equalized", True):
            raise ConfigError(
                f"{owner}.train_data yields a different number of batches on each of the {world_size} "
                "replicas, so one would wait forever in a collective the others never reach: open it with "
                "vertexrt.data.open_dataset(..., equalize='drop_remainder') (or equalize='pad')"
            )


def leading_size(batch: Any) -> int:
    """Examples in ``batch``: the leading dimension of the first array-like leaf (1 for a bare value)."""
    shape = getattr(batch, "shape", None)
    if shape is not None:
        return int(shape[0]) if len(shape) else 1
    kind = type(batch)
    if kind is dict or (kind is not list and kind is not tuple and isinstance(batch, Mapping)):
        return leading_size(next(iter(batch.values()))) if batch else 0
    if kind is list or kind is tuple or isinstance(batch, (list, tuple)):
        if batch and getattr(batch[0], "shape", None) is not None:
            return leading_size(batch[0])
        return len(batch)
    return 1

"""Whether a training loader resumes exactly after a preemption: :func:`resume_problem` names why not and the
fix; :func:`warn_if_inexact` logs it as a WARNING (``vertexrt.Trainer`` and the Lightning and Hugging Face
callbacks call it when training starts). Imports torch only when the loader is a torch one."""

from __future__ import annotations

import logging
import sys
from typing import Any

log = logging.getLogger(__name__)

__all__ = ["resume_problem", "warn_if_inexact"]

_FIX = "vertexrt.data.resumable_loader(dataset, batch_size=..., shuffle=True, seed=...)"


def resume_problem(loader: Any, *, restores_state_only: bool = False) -> str | None:
    """Why ``loader`` would not resume exactly, naming the fix; None when it would, or when vertexrt cannot
    tell (an iterable of your own).

    Args:
        restores_state_only: the training loop resumes a loader only through its own ``state_dict`` and
            calls ``set_epoch`` before loading it takes effect (Lightning). Otherwise (``vertexrt.Trainer``)
            a loader without state has its epoch's order replayed and the batches already seen skipped.
    """
    stateful = callable(getattr(loader, "state_dict", None)) and callable(
        getattr(loader, "load_state_dict", None)
    )
    if restores_state_only and stateful and _length(loader) is None:
        return (
            f"{_name(loader)} saves a position but has no len(): Lightning then reads one batch ahead of "
            "training, so the saved position skips that batch; for a vertexrt reader open it with "
            "equalize='drop_remainder' and read it through vertexrt.data.DataLoader"
        )
    if "torch" not in sys.modules:
        return None
    import torch.utils.data

    from vertexrt.data.torch import DataLoader as StreamingLoader

    if isinstance(loader, StreamingLoader) or not isinstance(loader, torch.utils.data.DataLoader):
        return None
    sampler = loader.sampler
    resumable = sys.modules.get("vertexrt.data.resumable")  # not imported: no loader of it (nor torchdata)
    ours = resumable is not None and isinstance(loader, resumable.ResumableLoader)
    if ours and isinstance(sampler, resumable.ResumableSampler):  # type: ignore[union-attr]
        return None
    if isinstance(loader.dataset, torch.utils.data.IterableDataset):
        if stateful or callable(getattr(loader.dataset, "state_dict", None)):
            return None
        return (
            f"{_name(loader)} reads an IterableDataset that saves no position: a resume starts its epoch "
            "over; read a vertexrt dataset through vertexrt.data.DataLoader"
        )
    if stateful and restores_state_only:
        return (
            f"{_name(loader)} saves a position without its epoch: a preemption saved on an epoch's last "
            f"batch resumes into an empty next epoch; use {_FIX}"
        )
    if stateful:
        return None
    if isinstance(sampler, torch.utils.data.RandomSampler):
        return (
            f"{_name(loader)} shuffles with a RandomSampler whose order a resume cannot replay: records are "
            f"trained on twice or skipped after a preemption; use {_FIX}"
        )
    if restores_state_only:
        return (
            f"{_name(loader)} saves no position (no state_dict()): a resume mid-epoch starts the epoch over "
            f"and trains on its first batches twice; use {_FIX}"
        )
    return None


def warn_if_inexact(loader: Any, where: str, *, restores_state_only: bool = False) -> str | None:
    """Log :func:`resume_problem` as a WARNING prefixed with ``where``; returns the message (None if none)."""
    problem = resume_problem(loader, restores_state_only=restores_state_only)
    if problem is not None:
        log.warning("%s: %s. A preemption will not resume exactly.", where, problem)
    return problem


def _length(loader: Any) -> int | None:
    try:
        return len(loader)
    except (TypeError, NotImplementedError):
        return None


def _name(loader: Any) -> str:
    return f"the training loader ({type(loader).__module__}.{type(loader).__qualname__})"

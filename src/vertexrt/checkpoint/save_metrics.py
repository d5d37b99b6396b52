"""A save's metrics, snapshotted on the training thread without a GPU sync and read on the writer.

Example:
    >>> snapped = snapshot({"loss": loss_tensor, "lr": 0.1})   # save(): no wait on the GPU
    >>> read(snapped)                                          # the writer thread, later
    {'loss': 0.25, 'lr': 0.1}
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from vertexrt.errors import CheckpointError


def snapshot(metrics: Mapping[str, Any] | None) -> dict[str, Any]:
    """The metrics as floats, or :class:`TensorMetric` snapshots for tensors (read later, without a sync).

    Raises:
        CheckpointError: a value is neither a number nor a one-element real tensor.
    """
    from vertexrt.checkpoint import adapters

    out: dict[str, Any] = {}
    for key, value in (metrics or {}).items():
        if adapters.is_torch_tensor(value):
            out[str(key)] = TensorMetric(str(key), value)
            continue
        try:
            out[str(key)] = float(value)
        except (TypeError, ValueError):
            raise CheckpointError(f"metrics[{key!r}] = {value!r} is not a number") from None
    return out


def read(metrics: dict[str, Any]) -> dict[str, float]:
    """The snapshotted metrics as floats (a CUDA one waits for its own copy only)."""
    return {key: float(value) for key, value in metrics.items()}


class TensorMetric:
    """A one-element tensor metric copied to host memory without waiting for the GPU; ``float()`` reads it.

    A CUDA value is copied non-blocking into pinned memory behind an event on its stream; ``float()`` (on the
    writer) waits for that event only, never on the training thread's ``save()``.
    """

    def __init__(self, key: str, value: Any) -> None:
        import torch

        if value.numel() != 1 or value.is_complex():
            raise CheckpointError(
                f"metrics[{key!r}] is a tensor of shape {list(value.shape)} and dtype {value.dtype}; "
                "pass one real number per metric"
            )
        self.event: Any = None
        source = value.detach().reshape(())
        if source.device.type == "cuda":
            self.host = torch.empty((), dtype=source.dtype, pin_memory=True)
            self.host.copy_(source, non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record(torch.cuda.current_stream(source.device))
        else:
            self.host = source.to("cpu", copy=True)

    def __float__(self) -> float:
        if self.event is not None:
            self.event.synchronize()
        return float(self.host)

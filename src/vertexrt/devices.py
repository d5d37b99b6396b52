"""Devices for this process: which GPU a local rank uses, the GPU inventory, NCCL defaults.

The selection logic is pure (it takes counts and strings, in :mod:`vertexrt.gpus`, below
:mod:`vertexrt.distributed`) so it can be tested without a GPU; this module fills the local rank and the
processes per node from the world (:func:`vertexrt.distributed.world_info`). The calls into CUDA, torch,
TensorFlow and ``nvidia-smi`` are thin and import a framework only when the program has already imported it.

Example:
    >>> from vertexrt import devices
    >>> devices.select_device(local_rank=1, local_world_size=4, num_gpus=4)
    'cuda:1'
    >>> devices.select_device(local_rank=0, local_world_size=1, num_gpus=0)
    'cpu'
"""

from __future__ import annotations

from typing import Any

from vertexrt import gpus
from vertexrt.distributed.detection import world_info
from vertexrt.errors import ConfigError
from vertexrt.gpus import (
    GPU,
    NCCL_DEFAULTS,
    apply_nccl_defaults,
    filter_visible,
    gpu_count,
    gpu_inventory,
    parse_nvidia_smi,
    select_device,
    visible_devices,
)

__all__ = [
    "GPU",
    "NCCL_DEFAULTS",
    "apply_nccl_defaults",
    "filter_visible",
    "gpu_count",
    "gpu_inventory",
    "parse_nvidia_smi",
    "select_device",
    "tf_memory_growth",
    "torch_device",
    "visible_devices",
    "warn_unused_gpus",
]


def warn_unused_gpus(local_world_size: int | None = None, num_gpus: int | None = None) -> bool:
    """Warn (once per process and shape) when this node has more visible GPUs than training processes, so
    some GPUs sit idle; returns whether that is the case. Defaults: ``world_info().local_world_size`` and
    :func:`gpu_count`. (One TF ``MirroredStrategy`` process drives every GPU: do not call it there.)

    Example:
        >>> warn_unused_gpus(local_world_size=1, num_gpus=8)  # doctest: +SKIP
        True
    """
    processes = world_info().local_world_size if local_world_size is None else local_world_size
    return gpus.warn_unused_gpus(processes, gpu_count() if num_gpus is None else num_gpus)


def torch_device(local_rank: int | None = None, local_world_size: int | None = None) -> Any:
    """The ``torch.device`` for this process (local rank from :func:`vertexrt.distributed.world_info`); warns
    when visible GPUs would sit idle (see :func:`warn_unused_gpus`)."""
    import torch

    if local_rank is None or local_world_size is None:
        me = world_info()
        local_rank, local_world_size = me.local_rank, me.local_world_size
    num_gpus = torch.cuda.device_count()
    device = torch.device(select_device(local_rank, local_world_size, num_gpus))
    warn_unused_gpus(local_world_size, num_gpus)
    return device


def tf_memory_growth(enabled: bool = True) -> int:
    """Opt in to TensorFlow GPU memory growth (allocate as needed, not all at start); returns the number of
    GPUs changed. Call before TensorFlow initialises its GPUs."""
    import tensorflow as tf

    listed = tf.config.list_physical_devices("GPU")
    try:
        for gpu in listed:
            tf.config.experimental.set_memory_growth(gpu, enabled)
    except RuntimeError as err:
        raise ConfigError(
            f"tf_memory_growth() ran after TensorFlow initialised its GPUs ({err}); call it at program "
            "start, before any op, model or strategy is created"
        ) from None
    return len(listed)

"""Distributed training on Vertex AI: one cluster model, TensorFlow and PyTorch bootstrapping, local-run.

Names resolve lazily: importing this package loads neither torch nor TensorFlow.

Example:
    >>> from vertexrt import distributed
    >>> c = distributed.cluster()          # CLUSTER_SPEC / TF_CONFIG / torchrun / MASTER_* / local
    >>> handle = distributed.init_torch()  # torch.distributed from the cluster (gloo or nccl)
    >>> strategy = distributed.setup_tensorflow()  # MultiWorkerMirrored / PS / Mirrored / default
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS: dict[str, str] = {
    "Cluster": "vertexrt.distributed.model",
    "Pool": "vertexrt.distributed.model",
    "cluster": "vertexrt.distributed.detection",
    "world_info": "vertexrt.distributed.detection",
    "WorldInfo": "vertexrt.distributed.detection",
    "ClusterSpecWarning": "vertexrt.distributed.sources",
    "tf_config": "vertexrt.distributed.tensorflow",
    "setup_tensorflow": "vertexrt.distributed.tensorflow",
    "init_torch": "vertexrt.distributed.torch",
    "TorchHandle": "vertexrt.distributed.torch",
    "spawn": "vertexrt.distributed.torch",
}

__all__ = sorted([*_EXPORTS, "launcher", "sources"])

if TYPE_CHECKING:
    from vertexrt.distributed.detection import WorldInfo, cluster, world_info  # noqa: F401
    from vertexrt.distributed.model import Cluster, Pool  # noqa: F401
    from vertexrt.distributed.sources import ClusterSpecWarning  # noqa: F401
    from vertexrt.distributed.tensorflow import setup_tensorflow, tf_config  # noqa: F401
    from vertexrt.distributed.torch import TorchHandle, init_torch, spawn  # noqa: F401


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
    elif name in ("launcher", "sources"):
        value = importlib.import_module(f"vertexrt.distributed.{name}")
    else:
        raise AttributeError(f"module 'vertexrt.distributed' has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__

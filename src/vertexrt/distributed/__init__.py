"""Distributed training on Vertex AI: one cluster model, TensorFlow and PyTorch bootstrapping, local-run.

Names resolve lazily: importing this package loads neither torch nor TensorFlow.

Example:
    >>> from vertexrt import distributed
    >>> c = distributed.cluster()          # CLUSTER_SPEC / TF_CONFIG / torchrun / MASTER_* / local
    >>> handle = distributed.init_torch()  # torch.distributed from the cluster (gloo or nccl)
    >>> strategy = distributed.setup_tensorflow()  # MultiWorkerMirrored / PS / Mirrored / default
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from vertexrt._lazy import lazy_exports

_EXPORTS: dict[str, str] = {
    "Cluster": "vertexrt.distributed.cluster_model",
    "Pool": "vertexrt.distributed.cluster_model",
    "cluster": "vertexrt.distributed.detection",
    "world_info": "vertexrt.distributed.detection",
    "WorldInfo": "vertexrt.distributed.detection",
    "ClusterSpecWarning": "vertexrt.errors",
    "tf_config": "vertexrt.distributed.tensorflow",
    "setup_tensorflow": "vertexrt.distributed.tensorflow",
    "init_torch": "vertexrt.distributed.torch",
    "TorchHandle": "vertexrt.distributed.torch",
    "spawn": "vertexrt.distributed.torch",
}

# Literal, so that type checkers see the exports.
__all__ = [
    "Cluster",
    "ClusterSpecWarning",
    "Pool",
    "TorchHandle",
    "WorldInfo",
    "cluster",
    "cluster_sources",
    "init_torch",
    "launcher",
    "setup_tensorflow",
    "spawn",
    "tf_config",
    "world_info",
]

if TYPE_CHECKING:
    from vertexrt.distributed import cluster_sources, launcher
    from vertexrt.distributed.cluster_model import Cluster, Pool
    from vertexrt.distributed.detection import (
        WorldInfo,
        cluster,
        world_info,
    )
    from vertexrt.distributed.tensorflow import setup_tensorflow, tf_config
    from vertexrt.distributed.torch import (
        TorchHandle,
        init_torch,
        spawn,
    )
    from vertexrt.errors import ClusterSpecWarning


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, ("cluster_sources", "launcher"), __all__)

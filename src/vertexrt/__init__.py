"""vertexrt: the runtime glue for training code on Vertex AI custom training.

Public names are resolved lazily, so ``import vertexrt`` loads no framework, no cloud client and no numpy.

Example:
    >>> import vertexrt
    >>> env = vertexrt.environment()
    >>> env.on_vertex, env.model_dir
"""

from __future__ import annotations

import importlib

TYPE_CHECKING = False  # not `from typing import ...`: importing typing costs ~10 ms

__version__ = "0.1.0"

# public name -> module that defines it
_EXPORTS: dict[str, str] = {
    "VertexrtError": "vertexrt.errors",
    "ConfigError": "vertexrt.errors",
    "ClusterSpecError": "vertexrt.errors",
    "PathError": "vertexrt.errors",
    "DataError": "vertexrt.errors",
    "CheckpointError": "vertexrt.errors",
    "MetricError": "vertexrt.errors",
    "Environment": "vertexrt.env",
    "environment": "vertexrt.env",
    "project_id": "vertexrt.env",
    "storage_options": "vertexrt.env",
    "bigquery_client": "vertexrt.env",
    "main": "vertexrt.runtime",
    "Context": "vertexrt.runtime",
    "Trainer": "vertexrt.runtime",
    "Preempted": "vertexrt.runtime",
    "CheckpointManager": "vertexrt.checkpoint",
    "EveryNSteps": "vertexrt.checkpoint",
    "EveryNSeconds": "vertexrt.checkpoint",
    "KeepLast": "vertexrt.checkpoint",
    "KeepEveryNSteps": "vertexrt.checkpoint",
    "KeepBest": "vertexrt.checkpoint",
    "rng_state": "vertexrt.checkpoint",
    "cluster": "vertexrt.distributed",
    "Cluster": "vertexrt.distributed",
    "world_info": "vertexrt.distributed",
    "init_torch": "vertexrt.distributed",
    "setup_tensorflow": "vertexrt.distributed",
    "spawn": "vertexrt.distributed",
    "tf_config": "vertexrt.distributed",
    "open_dataset": "vertexrt.data",
    "TFRecordWriter": "vertexrt.data",
}

_SUBMODULES = (
    "checkpoint",
    "cli",
    "data",
    "devices",
    "distributed",
    "emulator",
    "env",
    "errors",
    "hypertune",
    "keras",
    "paths",
    "runtime",
    "tensorboard",
)

__all__ = sorted([*_EXPORTS, *_SUBMODULES])

if TYPE_CHECKING:
    from vertexrt.checkpoint import (  # noqa: F401
        CheckpointManager,
        EveryNSeconds,
        EveryNSteps,
        KeepBest,
        KeepEveryNSteps,
        KeepLast,
        rng_state,
    )
    from vertexrt.data import TFRecordWriter, open_dataset  # noqa: F401
    from vertexrt.distributed import (  # noqa: F401
        Cluster,
        cluster,
        init_torch,
        setup_tensorflow,
        spawn,
        tf_config,
        world_info,
    )
    from vertexrt.env import (  # noqa: F401
        Environment,
        bigquery_client,
        environment,
        project_id,
        storage_options,
    )
    from vertexrt.errors import (  # noqa: F401
        CheckpointError,
        ClusterSpecError,
        ConfigError,
        DataError,
        MetricError,
        PathError,
        VertexrtError,
    )
    from vertexrt.runtime import Context, Preempted, Trainer, main  # noqa: F401


def __getattr__(name: str) -> object:
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
    elif name in _SUBMODULES:
        value = importlib.import_module(f"vertexrt.{name}")
    else:
        raise AttributeError(f"module 'vertexrt' has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__

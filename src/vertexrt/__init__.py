"""vertexrt: the runtime glue for training code on Vertex AI custom training.

Public names are resolved lazily, so ``import vertexrt`` loads no framework, no cloud client and no numpy.

Example:
    >>> import vertexrt
    >>> env = vertexrt.environment()
    >>> env.on_vertex, env.model_dir
"""

from __future__ import annotations

from vertexrt._lazy import lazy_exports
from vertexrt._version import __version__ as __version__

TYPE_CHECKING = False  # not `from typing import ...`: importing typing costs ~10 ms

# public name -> module that defines it
_EXPORTS: dict[str, str] = {
    "VertexrtError": "vertexrt.errors",
    "VertexrtWarning": "vertexrt.errors",
    "ConfigError": "vertexrt.errors",
    "ClusterSpecError": "vertexrt.errors",
    "PreflightError": "vertexrt.errors",
    "ClusterSpecWarning": "vertexrt.errors",
    "PathError": "vertexrt.errors",
    "DataError": "vertexrt.errors",
    "CheckpointError": "vertexrt.errors",
    "CheckpointCorruptError": "vertexrt.errors",
    "MetricError": "vertexrt.errors",
    "Environment": "vertexrt.env",
    "environment": "vertexrt.env",
    "project_id": "vertexrt.env",
    "storage_options": "vertexrt.clients",
    "bigquery_client": "vertexrt.clients",
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
    "profile": "vertexrt.runtime.profiling",
}

#: Submodules reachable as attributes (``vertexrt.paths``), imported on first use.
_SUBMODULES = (
    "checkpoint",
    "cli",
    "clients",
    "data",
    "devices",
    "distributed",
    "doctor",
    "emulator",
    "env",
    "errors",
    "hypertune",
    "keras",
    "paths",
    "phases",
    "runtime",
    "tensorboard",
    "uris",
)

# Literal, so that type checkers see the exports (mypy --strict: "does not explicitly export" otherwise).
# ``from vertexrt import *`` imports every name listed here, so it lists no module that needs an optional
# framework: ``keras`` (TensorFlow) stays an attribute, ``vertexrt.keras``.
__all__ = [
    "CheckpointCorruptError",
    "CheckpointError",
    "CheckpointManager",
    "Cluster",
    "ClusterSpecError",
    "ClusterSpecWarning",
    "ConfigError",
    "Context",
    "DataError",
    "Environment",
    "EveryNSeconds",
    "EveryNSteps",
    "KeepBest",
    "KeepEveryNSteps",
    "KeepLast",
    "MetricError",
    "PathError",
    "Preempted",
    "PreflightError",
    "TFRecordWriter",
    "Trainer",
    "VertexrtError",
    "VertexrtWarning",
    "bigquery_client",
    "checkpoint",
    "cli",
    "clients",
    "cluster",
    "data",
    "devices",
    "distributed",
    "doctor",
    "emulator",
    "env",
    "environment",
    "errors",
    "hypertune",
    "init_torch",
    "main",
    "open_dataset",
    "paths",
    "profile",
    "project_id",
    "rng_state",
    "runtime",
    "setup_tensorflow",
    "spawn",
    "storage_options",
    "tensorboard",
    "tf_config",
    "uris",
    "world_info",
]

if TYPE_CHECKING:
    from vertexrt import (
        checkpoint,
        cli,
        clients,
        data,
        devices,
        distributed,
        doctor,
        emulator,
        env,
        errors,
        hypertune,
        paths,
        runtime,
        tensorboard,
        uris,
    )
    from vertexrt.checkpoint import (
        CheckpointManager,
        EveryNSeconds,
        EveryNSteps,
        KeepBest,
        KeepEveryNSteps,
        KeepLast,
        rng_state,
    )
    from vertexrt.clients import bigquery_client, storage_options
    from vertexrt.data import TFRecordWriter, open_dataset
    from vertexrt.distributed import (
        Cluster,
        cluster,
        init_torch,
        setup_tensorflow,
        spawn,
        tf_config,
        world_info,
    )
    from vertexrt.env import Environment, environment, project_id
    from vertexrt.errors import (
        CheckpointCorruptError,
        CheckpointError,
        ClusterSpecError,
        ClusterSpecWarning,
        ConfigError,
        DataError,
        MetricError,
        PathError,
        PreflightError,
        VertexrtError,
        VertexrtWarning,
    )
    from vertexrt.runtime import Context, Preempted, Trainer, main
    from vertexrt.runtime.profiling import profile


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, _SUBMODULES, [*__all__, "__version__"])

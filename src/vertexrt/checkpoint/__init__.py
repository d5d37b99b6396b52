"""Checkpoints: framework-agnostic, atomic, asynchronous and preemption-safe.

Names resolve lazily, so ``import vertexrt.checkpoint`` loads no framework.

Example:
    >>> from vertexrt.checkpoint import CheckpointManager, EveryNSteps, KeepLast, rng_state
    >>> mgr = CheckpointManager("gs://bucket/run/ckpt", save_policy=EveryNSteps(100), keep_policy=KeepLast(3))
    >>> state = {"model": model, "opt": opt, "rng": rng_state(), "step": 0}
    >>> restored = mgr.restore(target=state)
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS: dict[str, str] = {
    "CheckpointManager": "vertexrt.checkpoint.manager",
    "FORMAT_VERSION": "vertexrt.checkpoint.manager",
    "CheckpointCorruptError": "vertexrt.checkpoint.datafiles",
    "EveryNSteps": "vertexrt.checkpoint.policies",
    "EveryNSeconds": "vertexrt.checkpoint.policies",
    "AnySave": "vertexrt.checkpoint.policies",
    "KeepLast": "vertexrt.checkpoint.policies",
    "KeepEveryNSteps": "vertexrt.checkpoint.policies",
    "KeepBest": "vertexrt.checkpoint.policies",
    "AnyKeep": "vertexrt.checkpoint.policies",
    "SavePolicy": "vertexrt.checkpoint.policies",
    "KeepPolicy": "vertexrt.checkpoint.policies",
    "CheckpointInfo": "vertexrt.checkpoint.policies",
    "LastSave": "vertexrt.checkpoint.policies",
    "rng_state": "vertexrt.checkpoint.rng",
    "RngState": "vertexrt.checkpoint.rng",
    "PreemptionNotice": "vertexrt.checkpoint.preemption",
    "EXIT_CODE": "vertexrt.checkpoint.preemption",
}

__all__ = sorted(_EXPORTS)

if TYPE_CHECKING:
    from vertexrt.checkpoint.datafiles import CheckpointCorruptError  # noqa: F401
    from vertexrt.checkpoint.manager import FORMAT_VERSION, CheckpointManager  # noqa: F401
    from vertexrt.checkpoint.policies import (  # noqa: F401
        AnyKeep,
        AnySave,
        CheckpointInfo,
        EveryNSeconds,
        EveryNSteps,
        KeepBest,
        KeepEveryNSteps,
        KeepLast,
        KeepPolicy,
        LastSave,
        SavePolicy,
    )
    from vertexrt.checkpoint.preemption import EXIT_CODE, PreemptionNotice  # noqa: F401
    from vertexrt.checkpoint.rng import RngState, rng_state  # noqa: F401


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'vertexrt.checkpoint' has no attribute {name!r}")


def __dir__() -> list[str]:
    return __all__

"""Checkpoints: framework-agnostic, atomic, asynchronous and preemption-safe.

Names resolve lazily, so ``import vertexrt.checkpoint`` loads no framework.

Example:
    >>> from vertexrt.checkpoint import CheckpointManager, EveryNSteps, KeepLast, rng_state
    >>> mgr = CheckpointManager("gs://bucket/run/ckpt", save_policy=EveryNSteps(100), keep_policy=KeepLast(3))
    >>> state = {"model": model, "opt": opt, "rng": rng_state(), "step": 0}
    >>> restored = mgr.restore(target=state)
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from vertexrt._lazy import lazy_exports

_EXPORTS: dict[str, str] = {
    "CheckpointManager": "vertexrt.checkpoint.manager",
    "FORMAT_VERSION": "vertexrt.checkpoint.manifest",
    "CheckpointCorruptError": "vertexrt.errors",
    "StepExistsError": "vertexrt.errors",
    "StorageError": "vertexrt.errors",
    "EveryNSteps": "vertexrt.checkpoint.policies",
    "FastTier": "vertexrt.checkpoint.tiers.config",
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
    "YoungDaly": "vertexrt.checkpoint.policies",
    "rng_state": "vertexrt.checkpoint.rng",
    "RngState": "vertexrt.checkpoint.rng",
    "PREEMPTED_EXIT_CODE": "vertexrt.preemption.signals",
}

__all__ = [
    "PREEMPTED_EXIT_CODE",
    "AnyKeep",
    "AnySave",
    "CheckpointCorruptError",
    "CheckpointInfo",
    "CheckpointManager",
    "EveryNSeconds",
    "EveryNSteps",
    "FORMAT_VERSION",
    "FastTier",
    "KeepBest",
    "KeepEveryNSteps",
    "KeepLast",
    "KeepPolicy",
    "LastSave",
    "RngState",
    "SavePolicy",
    "StepExistsError",
    "StorageError",
    "YoungDaly",
    "rng_state",
]

if TYPE_CHECKING:
    from vertexrt.checkpoint.manager import CheckpointManager
    from vertexrt.checkpoint.manifest import FORMAT_VERSION
    from vertexrt.checkpoint.policies import (
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
        YoungDaly,
    )
    from vertexrt.checkpoint.rng import RngState, rng_state
    from vertexrt.checkpoint.tiers.config import FastTier
    from vertexrt.errors import CheckpointCorruptError, StepExistsError, StorageError
    from vertexrt.preemption.signals import PREEMPTED_EXIT_CODE


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, listed=__all__)

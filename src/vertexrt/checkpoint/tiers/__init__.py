"""The fast checkpoint tier: every few steps each rank's state on local disk plus a copy on a peer VM.

- :mod:`.config`: :class:`FastTier` (what the user asks for) and the local directory it writes to;
- :mod:`.local`: one directory of committed fast steps (temp directory + rename, the newest two kept);
- :mod:`.peers`: which ranks hold whose copy, and a step's files sent point to point (gloo);
- :mod:`.plan`: the newest step every rank can get (own copy, a peer's copy, else the durable tier);
- :mod:`.grace`: the emergency save sized to the preemption grace period;
- :mod:`.engine`: the asynchronous snapshot / write / send, the restore and the emergency, for the manager.
- :mod:`.attach`: the manager's side (the tier from its options, restoring one tree or the Trainer's parts
  with rank 0's state sent as raw bytes, the durable write rate).

Example:
    >>> from vertexrt.checkpoint import CheckpointManager, EveryNSteps, FastTier
    >>> mgr = CheckpointManager("gs://bucket/run/ckpt", save_policy=EveryNSteps(1000),
    ...                         fast=FastTier(every=EveryNSteps(50), peers=1))
"""

from __future__ import annotations

from vertexrt.checkpoint.tiers.config import FastTier

__all__ = ["FastTier"]

"""The fast tier attached to a durable :class:`~vertexrt.checkpoint.CheckpointManager`.

- :func:`attach`: the tier's engine for the manager's options (``fast=`` or the environment), or None;
- :func:`newest`: the fast step a plain ``restore()`` loads, when every rank can get one as new as the
  durable tier's newest;
- :func:`newest_with_durable` and :func:`decode_parts`: the Trainer's restore of several sub-trees, rank 0's
  share sent to the ranks that ask for it;
- :func:`durable_write`: times each durable write (the emergency save's rate estimate).

The manager is seen through :class:`~vertexrt.checkpoint.step_writer.Site` and its storage strategy only.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import replace
from typing import Any

from vertexrt.checkpoint import dcp, restoring
from vertexrt.checkpoint.step_writer import Site
from vertexrt.checkpoint.storage import Strategy
from vertexrt.checkpoint.tiers.config import FastTier
from vertexrt.checkpoint.tiers.engine import FastCheckpoints
from vertexrt.distributed import collectives
from vertexrt.errors import ConfigError


def attach(fast: FastTier | None, site: Site, *, allow_pickle: bool) -> FastCheckpoints | None:
    """The fast tier under ``site`` (``fast``, else ``FastTier.from_environment()``), or None.

    Raises:
        ConfigError: ``fast`` is not a :class:`FastTier`.
    """
    tier = fast if fast is not None else FastTier.from_environment()
    if tier is None:
        return None
    if not isinstance(tier, FastTier):
        raise ConfigError(f"CheckpointManager(fast={tier!r}): pass a vertexrt.checkpoint.FastTier")
    return FastCheckpoints(
        tier,
        durable_directory=site.directory,
        rank=site.rank,
        world_size=site.world_size,
        allow_pickle=allow_pickle,
    )


def newest(engine: FastCheckpoints | None, strategy: Strategy, target: Any) -> restoring.Loaded | None:
    """The fast tier's newest step when every rank can get it and it is not older than the durable one
    (None without a tier, or for sharded DTensor state, which the durable tier restores through DCP)."""
    if engine is None or dcp.holds_dtensors(target):
        return None
    return engine.restore(strategy.committed_steps)


def check_parts(parts: Sequence[tuple[Any, int | None]], rank: int) -> None:
    """Raise ConfigError when a part asks for another rank's state than its own or rank 0's."""
    for _, shard in parts:
        if shard not in (None, rank, 0):
            raise ConfigError(
                f"restore_fast_shards(shard={shard}) on rank {rank}: the fast tier gives this "
                "rank's own state (shard None) and rank 0's (shard 0)"
            )


def newest_with_durable(engine: FastCheckpoints, strategy: Strategy) -> tuple[restoring.Loaded, bool] | None:
    """This rank's state at the fast tier's agreed step, and (on rank 0; False elsewhere) whether the
    durable tier holds that step too; None when the durable tier is newer. Every rank calls it together."""
    newest_durable: list[int | None] = [None]  # rank 0: what the fast tier compared with

    def durable_steps() -> list[int]:
        steps = strategy.committed_steps()
        newest_durable[0] = max(steps, default=None)
        return steps

    own = engine.restore(durable_steps)
    return None if own is None else (own, newest_durable[0] == own.step)


def decode_parts(
    own: restoring.Loaded,
    in_durable: bool,
    parts: Sequence[tuple[Any, int | None]],
    *,
    rank: int,
    world_size: int,
    device: Any = None,
) -> tuple[list[Any], bool]:
    """Each ``(target, shard)`` of ``parts`` decoded from this rank's state (shard None or ``rank``) or
    rank 0's (shard 0), which rank 0 broadcasts when any other rank asks for it; and rank 0's
    ``in_durable``. Every rank calls it together.

    Rank 0's state travels as its header, tree and leaf sizes in one object broadcast (a few KB whatever
    the state's size), then its leaf bytes as raw uint8 tensors (:func:`collectives.broadcast_bytes`)."""
    dist = collectives.torch_dist() if world_size > 1 else None
    [wanted] = collectives.all_max([int(rank != 0 and any(s == 0 for _, s in parts))], dist)
    described = None  # rank 0's state at the agreed step without its bytes, and its leaf sizes
    if rank == 0 and wanted:
        described = (replace(own, buffers=[]), [len(b) for b in own.buffers])
    in_durable, described = collectives.broadcast((in_durable, described), dist)
    chiefs = own
    if described is not None:
        shell, sizes = described
        buffers = collectives.broadcast_bytes(own.buffers if rank == 0 else None, sizes, dist)
        chiefs = own if rank == 0 else replace(shell, buffers=buffers)
    values = [
        restoring.decode(own if shard in (None, rank) else chiefs, target, device) for target, shard in parts
    ]
    return values, bool(in_durable)


@contextmanager
def durable_write(engine: FastCheckpoints | None, buffers: Sequence[Any]) -> Iterator[None]:
    """Time the durable write of ``buffers`` in the block and report its rate to the fast tier (which sizes
    an emergency save with it); a write that raises is not reported."""
    began = time.monotonic()
    yield
    if engine is not None:
        engine.observe_durable_write(sum(len(b) for b in buffers), time.monotonic() - began)

"""Which cluster this process is part of, read from the environment at call time.

Detection order (the first source present wins):

1. ``torchrun`` — ``LOCAL_RANK``/``LOCAL_WORLD_SIZE``/``TORCHELASTIC_*``: torchrun, torch elastic,
   :func:`vertexrt.distributed.spawn` or ``local-run --processes-per-node``; pools and role still come from
   the node's CLUSTER_SPEC or TF_CONFIG.
2. ``CLUSTER_SPEC`` — Vertex AI (every replica; the only variable on single-replica jobs).
3. ``TF_CONFIG`` — legacy AI Platform, or set by the user.
4. ``MASTER_ADDR`` — ``MASTER_ADDR``/``MASTER_PORT``/``RANK``/``WORLD_SIZE`` (node level on Vertex).
5. ``local`` — none of the above: one process.

Example:
    >>> from vertexrt.distributed import cluster
    >>> c = cluster()
    >>> c.source, c.rank, c.world_size, c.is_chief
    ('local', 0, 1, True)
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass

from vertexrt.distributed.model import Cluster
from vertexrt.distributed.sources import SOURCES


def cluster(environ: Mapping[str, str] | None = None) -> Cluster:
    """The :class:`Cluster` described by ``environ`` (default ``os.environ``), never cached.

    Raises:
        ClusterSpecError: a cluster variable is malformed; the message names the variable and the field.
    """
    env = os.environ if environ is None else environ
    for source in SOURCES:
        if source.detect(env):
            return source.read(env)
    raise AssertionError("LocalSource always applies")  # pragma: no cover


@dataclass(frozen=True)
class WorldInfo:
    """The training world as it stands right now (see :func:`world_info`)."""

    rank: int
    world_size: int
    local_rank: int
    source: str

    @property
    def is_chief(self) -> bool:
        return self.rank == 0


def world_info() -> WorldInfo:
    """Rank and world size right now: ``torch.distributed`` when it is initialised, else :func:`cluster`.

    Never imports torch: if the program has not imported it, no process group can exist.

    Example:
        >>> from vertexrt.distributed import world_info
        >>> w = world_info()
        >>> if w.is_chief: ...
    """
    current = cluster()
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        return WorldInfo(dist.get_rank(), dist.get_world_size(), current.local_rank, "torch.distributed")
    return WorldInfo(current.rank, current.world_size, current.local_rank, current.source)

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
from dataclasses import dataclass, field

from vertexrt.distributed.cluster_model import Cluster
from vertexrt.distributed.cluster_sources import SOURCES
from vertexrt.errors import ClusterSpecError


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
    """Which process this is in the training world right now (see :func:`world_info`).

    ``rank``/``world_size`` count processes; ``rank`` is -1 outside the training world (parameter servers,
    Reduction Server, evaluators). ``local_rank``/``local_world_size`` raise :class:`ClusterSpecError` when
    they cannot be known (see :func:`world_info`) instead of guessing 0 and 1.
    """

    rank: int
    world_size: int
    source: str
    local: tuple[int, int] | None = field(default=(0, 1), repr=False)
    unknown_local: str = field(default="", repr=False)

    @property
    def is_chief(self) -> bool:
        """True on global rank 0 of the training world: the one process that writes."""
        return self.rank == 0

    @property
    def local_rank(self) -> int:
        """This process's index on its replica (VM): which GPU it owns."""
        return self._local()[0]

    @property
    def local_world_size(self) -> int:
        """Processes on this replica (VM)."""
        return self._local()[1]

    def _local(self) -> tuple[int, int]:
        if self.local is None:
            raise ClusterSpecError(self.unknown_local)
        return self.local


def world_info() -> WorldInfo:
    """Which process this is (rank, world size, local rank, chief): the one answer every module asks for.

    ``torch.distributed``'s rank and world size when a process group is initialised, else the
    :func:`cluster` model's. It never guesses: a malformed cluster variable raises, and when the process group
    is not the world the cluster variables describe and ``LOCAL_RANK`` is unset, ``local_rank`` raises.
    Never imports torch: if the program has not imported it, no process group can exist.

    Raises:
        ClusterSpecError: a cluster variable (CLUSTER_SPEC, TF_CONFIG, RANK, LOCAL_RANK, ...) is malformed or
            inconsistent; the message names the variable and what would fix it.

    Example:
        >>> from vertexrt.distributed import world_info
        >>> w = world_info()
        >>> if w.is_chief: ...
    """
    current = cluster()
    local = (current.local_rank, current.local_world_size)
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return WorldInfo(current.rank, current.world_size, current.source, local)
    rank, world_size = dist.get_rank(), dist.get_world_size()
    if current.source == "torchrun" or (rank, world_size) == (current.rank, current.world_size):
        return WorldInfo(rank, world_size, "torch.distributed", local)
    why = (
        f"torch.distributed is rank {rank} of {world_size} but {current.source} describes rank "
        f"{current.rank} of {current.world_size} and LOCAL_RANK is not set, so which GPU this process owns "
        "is unknown; set LOCAL_RANK and LOCAL_WORLD_SIZE in each process (torchrun and "
        "vertexrt.distributed.spawn do)"
    )
    return WorldInfo(rank, world_size, "torch.distributed", None, why)

"""``MASTER_ADDR``/``MASTER_PORT``/``RANK``/``WORLD_SIZE``: PyTorch's ``env://`` convention.

On Vertex and legacy AI Platform these are node level (one process per VM) and only set on multi-replica
jobs. Rank 0 is the chief; rank ``r > 0`` is worker ``r - 1``. ``MASTER_PORT`` defaults to 29500.
"""

from __future__ import annotations

from collections.abc import Mapping

from vertexrt.distributed.cluster_model import Cluster
from vertexrt.distributed.cluster_sources.base import ClusterSource, int_env, rendezvous_from_master, trial_id
from vertexrt.errors import ClusterSpecError

DEFAULT_PORT = 29500


class MasterSource(ClusterSource):
    """Reads ``MASTER_ADDR``, ``MASTER_PORT``, ``RANK`` and ``WORLD_SIZE``."""

    name = "MASTER_ADDR"

    @staticmethod
    def detect(environ: Mapping[str, str]) -> bool:
        return any(name in environ for name in ("MASTER_ADDR", "RANK", "WORLD_SIZE"))

    @staticmethod
    def read(environ: Mapping[str, str]) -> Cluster:
        rank, world_size = rank_and_world_size(environ)
        address = rendezvous_from_master(environ, default_port=DEFAULT_PORT)
        if address is None and world_size > 1:
            raise ClusterSpecError(
                f"WORLD_SIZE={world_size} but MASTER_ADDR is not set: the processes have nowhere to meet; "
                "set MASTER_ADDR (and MASTER_PORT) to rank 0's host"
            )
        return Cluster(
            source=MasterSource.name,
            role="chief" if rank == 0 else "worker",
            task_index=0 if rank == 0 else rank - 1,
            node_rank=rank,
            num_nodes=world_size,
            rank=rank,
            world_size=world_size,
            chief_address=address,
            rendezvous_address=address,
            trial_id=trial_id(environ),
        )


def rank_and_world_size(environ: Mapping[str, str]) -> tuple[int, int]:
    """``RANK`` and ``WORLD_SIZE``, both or neither (then 0 and 1), with ``0 <= RANK < WORLD_SIZE``."""
    rank = int_env(environ, "RANK", minimum=0)
    world_size = int_env(environ, "WORLD_SIZE", minimum=1)
    if (rank is None) != (world_size is None):
        present, missing = ("RANK", "WORLD_SIZE") if rank is not None else ("WORLD_SIZE", "RANK")
        raise ClusterSpecError(f"{present} is set but {missing} is not; set both or neither")
    if rank is None or world_size is None:
        return 0, 1
    if rank >= world_size:
        raise ClusterSpecError(
            f"RANK={rank} is out of range for WORLD_SIZE={world_size} (0..{world_size - 1})"
        )
    return rank, world_size

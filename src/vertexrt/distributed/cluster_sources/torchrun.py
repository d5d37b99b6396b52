"""A torchrun / torch elastic launch (also :func:`vertexrt.distributed.spawn` and ``local-run
--processes-per-node``): ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, process-level ``RANK``/``WORLD_SIZE``,
``GROUP_RANK``/``GROUP_WORLD_SIZE`` (node rank and count) and ``MASTER_ADDR``/``MASTER_PORT``.

Inside a Vertex node the pools, role and trial still come from CLUSTER_SPEC (or TF_CONFIG).
"""

from __future__ import annotations

from collections.abc import Mapping

from vertexrt.distributed.cluster_model import Cluster
from vertexrt.distributed.cluster_sources import cluster_spec, tf_config
from vertexrt.distributed.cluster_sources.base import (
    ClusterJSON,
    ClusterSource,
    int_env,
    rendezvous_from_master,
    trial_id,
)
from vertexrt.distributed.cluster_sources.master import rank_and_world_size
from vertexrt.errors import ClusterSpecError


class TorchrunSource(ClusterSource):
    """Reads the variables torchrun gives each worker process."""

    name = "torchrun"

    @staticmethod
    def detect(environ: Mapping[str, str]) -> bool:
        return "LOCAL_RANK" in environ or any(k.startswith("TORCHELASTIC_") for k in environ)

    @staticmethod
    def read(environ: Mapping[str, str]) -> Cluster:
        local_rank = int_env(environ, "LOCAL_RANK", minimum=0)
        local_world_size = int_env(environ, "LOCAL_WORLD_SIZE", minimum=1)
        if local_rank is None or local_world_size is None:
            missing = "LOCAL_RANK" if local_rank is None else "LOCAL_WORLD_SIZE"
            raise ClusterSpecError(
                f"a torchrun launch was detected but {missing} is not set; launch with torchrun >= 1.9 or "
                "vertexrt.distributed.spawn()"
            )
        if local_rank >= local_world_size:
            raise ClusterSpecError(
                f"LOCAL_RANK={local_rank} is out of range for LOCAL_WORLD_SIZE={local_world_size}"
            )
        if "RANK" not in environ:
            raise ClusterSpecError("a torchrun launch was detected but RANK is not set")
        rank, world_size = rank_and_world_size(environ)
        nodes = -(-world_size // local_world_size)
        node_rank = int_env(environ, "GROUP_RANK", minimum=0)
        num_nodes = int_env(environ, "GROUP_WORLD_SIZE", minimum=1) or nodes
        if node_rank is None:
            node_rank = rank // local_world_size
        if node_rank >= num_nodes:
            raise ClusterSpecError(f"GROUP_RANK={node_rank} is out of range for GROUP_WORLD_SIZE={num_nodes}")
        rendezvous = rendezvous_from_master(environ)
        spec = _node_spec(environ)
        return Cluster(
            source=TorchrunSource.name,
            role=spec.role if spec else ("chief" if node_rank == 0 else "worker"),
            task_index=spec.task_index if spec else max(node_rank - 1, 0),
            pools=spec.pools if spec else (),
            node_rank=node_rank,
            num_nodes=num_nodes,
            local_rank=local_rank,
            local_world_size=local_world_size,
            rank=rank,
            world_size=world_size,
            chief_address=spec.chief_address if spec else rendezvous,
            rendezvous_address=rendezvous,
            trial_id=trial_id(environ, spec.trial if spec else None),
        )


def _node_spec(environ: Mapping[str, str]) -> ClusterJSON | None:
    """The node's CLUSTER_SPEC (else TF_CONFIG), if the launch runs inside a described cluster."""
    if environ.get(cluster_spec.VARIABLE, "").strip():
        return cluster_spec.parse(environ[cluster_spec.VARIABLE], environ)
    if not tf_config.is_empty(environ.get(tf_config.VARIABLE, "")):
        return tf_config.parse(environ[tf_config.VARIABLE])
    return None

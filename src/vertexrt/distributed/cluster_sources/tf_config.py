"""``TF_CONFIG``: legacy AI Platform, TensorFlow's own tutorials, or set by hand.

Task types ``chief`` (legacy ``master``), ``worker``, ``ps`` and ``evaluator``. Without a chief pool,
worker 0 is the chief (TensorFlow's rule). ``TF_CONFIG={}`` means no cluster, as in TensorFlow.
"""

from __future__ import annotations

from collections.abc import Mapping

from vertexrt.distributed.cluster_model import Cluster
from vertexrt.distributed.cluster_sources.base import (
    ClusterJSON,
    ClusterSource,
    parse_cluster_json,
    rendezvous_from_master,
    trial_id,
)

VARIABLE = "TF_CONFIG"
POOL_ROLES = {"chief": "chief", "master": "chief", "worker": "worker", "ps": "ps", "evaluator": "evaluator"}


def parse(text: str) -> ClusterJSON:
    """Parse a TF_CONFIG value strictly (see :func:`parse_cluster_json`)."""
    return parse_cluster_json(VARIABLE, text, POOL_ROLES, task_only_roles=("evaluator",))


def is_empty(text: str) -> bool:
    return text.strip() in ("", "{}")


class TFConfigSource(ClusterSource):
    """Reads ``TF_CONFIG`` (one process per replica)."""

    name = "TF_CONFIG"

    @staticmethod
    def detect(environ: Mapping[str, str]) -> bool:
        return not is_empty(environ.get(VARIABLE, ""))

    @staticmethod
    def read(environ: Mapping[str, str]) -> Cluster:
        spec = parse(environ[VARIABLE])
        return cluster_from_json(spec, environ, source=TFConfigSource.name)


def cluster_from_json(spec: ClusterJSON, environ: Mapping[str, str], *, source: str) -> Cluster:
    """A one-process-per-node :class:`Cluster` from a parsed CLUSTER_SPEC or TF_CONFIG."""
    return Cluster(
        source=source,
        role=spec.role,
        task_index=spec.task_index,
        pools=spec.pools,
        node_rank=spec.node_rank,
        num_nodes=spec.num_nodes,
        rank=spec.node_rank,
        world_size=spec.num_nodes,
        chief_address=spec.chief_address,
        rendezvous_address=rendezvous_from_master(environ) or spec.chief_address,
        trial_id=trial_id(environ, spec.trial),
    )

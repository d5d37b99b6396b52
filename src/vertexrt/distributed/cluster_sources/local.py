"""No cluster variable at all: a single local process (a single-replica Vertex job without CLUSTER_SPEC)."""

from __future__ import annotations

from collections.abc import Mapping

from vertexrt.distributed.cluster_model import Cluster
from vertexrt.distributed.cluster_sources.base import ClusterSource, trial_id


class LocalSource(ClusterSource):
    """Always applies; the last resort."""

    name = "local"

    @staticmethod
    def detect(environ: Mapping[str, str]) -> bool:
        return True

    @staticmethod
    def read(environ: Mapping[str, str]) -> Cluster:
        return Cluster(source=LocalSource.name, trial_id=trial_id(environ))

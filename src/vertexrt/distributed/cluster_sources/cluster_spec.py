"""``CLUSTER_SPEC``: set by Vertex AI on every replica.

Pools ``workerpool0`` (the primary: chief), ``workerpool1`` (workers), ``workerpool2`` (parameter servers or
Reduction Server) and ``workerpool3`` (evaluators); legacy AI Platform names (``master``, ``worker``,
``ps``, ``evaluator``) are accepted too. Whether workerpool2 is a Reduction Server cannot be read from
CLUSTER_SPEC: ``VERTEXRT_WORKERPOOL2=ps|reduction_server`` says so; otherwise it is ``ps`` when TF_CONFIG
lists a ``ps`` pool (or is absent) and ``reduction_server`` when TF_CONFIG lists none.

When TF_CONFIG or ``RANK``/``WORLD_SIZE`` disagree with CLUSTER_SPEC, CLUSTER_SPEC wins and a
:class:`~vertexrt.errors.ClusterSpecWarning` names both.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping

from vertexrt.distributed.cluster_model import Cluster
from vertexrt.distributed.cluster_sources import tf_config
from vertexrt.distributed.cluster_sources.base import (
    ClusterJSON,
    ClusterSource,
    parse_cluster_json,
    small_int,
)
from vertexrt.errors import ClusterSpecError, ClusterSpecWarning

VARIABLE = "CLUSTER_SPEC"
WORKERPOOL2_VARIABLE = "VERTEXRT_WORKERPOOL2"
_LEGACY = {"chief": "chief", "master": "chief", "worker": "worker", "ps": "ps", "evaluator": "evaluator"}


def parse(text: str, environ: Mapping[str, str]) -> ClusterJSON:
    """Parse a CLUSTER_SPEC value strictly; ``environ`` decides the role of workerpool2."""
    roles = {
        "workerpool0": "chief",
        "workerpool1": "worker",
        "workerpool2": _workerpool2_role(environ),
        "workerpool3": "evaluator",
        **_LEGACY,
    }
    spec = parse_cluster_json(VARIABLE, text, roles)
    if spec.pool("chief") is None:
        raise ClusterSpecError(
            f"{VARIABLE}: field 'cluster' has no 'workerpool0' (the primary replica); Vertex always sets it"
        )
    return spec


def _workerpool2_role(environ: Mapping[str, str]) -> str:
    explicit = environ.get(WORKERPOOL2_VARIABLE)
    if explicit is not None:
        if explicit not in ("ps", "reduction_server"):
            raise ClusterSpecError(
                f"{WORKERPOOL2_VARIABLE}={explicit!r}: expected 'ps' or 'reduction_server'"
            )
        return explicit
    text = environ.get(tf_config.VARIABLE, "")
    if tf_config.is_empty(text):
        return "ps"
    try:
        listed = tf_config.parse(text).pool("ps") is not None
    except ClusterSpecError:
        return "ps"  # reported by the consistency check
    return "ps" if listed else "reduction_server"


class ClusterSpecSource(ClusterSource):
    """Reads ``CLUSTER_SPEC`` (Vertex: one process per replica)."""

    name = "CLUSTER_SPEC"

    @staticmethod
    def detect(environ: Mapping[str, str]) -> bool:
        return bool(environ.get(VARIABLE, "").strip())

    @staticmethod
    def read(environ: Mapping[str, str]) -> Cluster:
        spec = parse(environ[VARIABLE], environ)
        check_consistency(spec, environ)
        return tf_config.cluster_from_json(spec, environ, source=ClusterSpecSource.name)


def check_consistency(spec: ClusterJSON, environ: Mapping[str, str]) -> None:
    """Warn (naming both variables) where TF_CONFIG or RANK/WORLD_SIZE contradict CLUSTER_SPEC."""
    text = environ.get(tf_config.VARIABLE, "")
    other = None
    if not tf_config.is_empty(text):
        try:
            other = tf_config.parse(text)
        except ClusterSpecError as err:  # CLUSTER_SPEC is what Vertex's own code trusts: go on with it
            _warn(f"{err}; using CLUSTER_SPEC")
    if other is not None:
        mine = {p.role: p.addresses for p in spec.pools if p.role in ("chief", "worker", "ps")}
        theirs = {p.role: p.addresses for p in other.pools if p.role in ("chief", "worker", "ps")}
        if mine != theirs:
            _warn(f"CLUSTER_SPEC lists {mine} but TF_CONFIG lists {theirs}")
        if (spec.role, spec.task_index) != (other.role, other.task_index):
            _warn(
                f"CLUSTER_SPEC says this task is {spec.role} {spec.task_index} but TF_CONFIG says "
                f"{other.role} {other.task_index}"
            )
    if spec.node_rank >= 0:
        for name, expected in (("RANK", spec.node_rank), ("WORLD_SIZE", spec.num_nodes)):
            value = small_int(environ.get(name, ""))
            if value is not None and value != expected:
                _warn(f"CLUSTER_SPEC makes this node {name}={expected} but {name}={value}")


def _warn(message: str) -> None:
    warnings.warn(f"{message}; using CLUSTER_SPEC", ClusterSpecWarning, stacklevel=4)

"""Checks of the runtime contract for common mistakes, as shown by ``vertexrt info``.

Example:
    >>> for warning in vertexrt.diagnostics.contract_warnings():
    ...     print("warning:", warning)
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any

from vertexrt.errors import ConfigError

# CLUSTER_SPEC pool -> the TF_CONFIG task names Vertex (and legacy AI Platform) use for it.
_TF_NAMES = {"workerpool0": ("chief", "master"), "workerpool1": ("worker",), "workerpool2": ("ps",)}


def contract_warnings(environ: Mapping[str, str] | None = None) -> list[str]:
    """Human-readable warnings about the contract this process sees (empty when all is well).

    Malformed ``CLUSTER_SPEC``/``TF_CONFIG`` are reported by :func:`vertexrt.distributed.cluster`; this
    adds what no single variable shows.
    """
    environ = os.environ if environ is None else environ
    warnings: list[str] = []
    cluster_spec, tf_config = _json_object(environ, "CLUSTER_SPEC"), _json_object(environ, "TF_CONFIG")
    if cluster_spec is not None and tf_config is not None:
        warnings += _disagreements(cluster_spec, tf_config)
    on_vertex = bool(environ.get("CLOUD_ML_JOB_ID") or environ.get("CLUSTER_SPEC"))
    if on_vertex:
        for name in ("AIP_MODEL_DIR", "AIP_CHECKPOINT_DIR", "AIP_TENSORBOARD_LOG_DIR"):
            value = environ.get(name)
            if value is not None and not value.strip().startswith("gs://"):
                warnings.append(
                    f"{name}={value!r} is not a gs:// URI: on Vertex anything else is lost when the job ends"
                )
            elif value is None:
                warnings.append(
                    f"{name} is not set (the job has no baseOutputDirectory): outputs fall back to the "
                    "container's disk and are lost when the job ends"
                )
    from vertexrt.env import project_id

    try:
        project_id()
    except ConfigError as err:
        warnings.append(f"project not resolvable: {err}")
    return warnings


def _json_object(environ: Mapping[str, str], name: str) -> dict[str, Any] | None:
    try:
        value = json.loads(environ.get(name) or "null")
    except ValueError:
        return None
    ok = isinstance(value, dict) and all(isinstance(value.get(k, {}), dict) for k in ("cluster", "task"))
    return value if ok else None


def _disagreements(cluster_spec: dict[str, Any], tf_config: dict[str, Any]) -> list[str]:
    problems = []
    spec_cluster, tf_cluster = cluster_spec.get("cluster") or {}, tf_config.get("cluster") or {}
    for pool, names in _TF_NAMES.items():
        spec_hosts = spec_cluster.get(pool)
        tf_hosts = next((tf_cluster[n] for n in names if n in tf_cluster), None)
        if spec_hosts is not None and tf_hosts is not None and list(spec_hosts) != list(tf_hosts):
            problems.append(
                f"CLUSTER_SPEC cluster.{pool} {spec_hosts} and TF_CONFIG cluster.{'/'.join(names)} "
                f"{tf_hosts} disagree"
            )
    spec_task, tf_task = cluster_spec.get("task") or {}, tf_config.get("task") or {}
    expected = _TF_NAMES.get(str(spec_task.get("type")), ("evaluator",))
    if tf_task and (
        tf_task.get("type") not in expected or str(tf_task.get("index")) != str(spec_task.get("index"))
    ):
        problems.append(
            f"CLUSTER_SPEC task {spec_task.get('type')}:{spec_task.get('index')} and TF_CONFIG task "
            f"{tf_task.get('type')}:{tf_task.get('index')} disagree"
        )
    return problems

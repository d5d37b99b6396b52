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
    """Human-readable warnings about the contract this process sees (empty when all is well)."""
    environ = os.environ if environ is None else environ
    warnings: list[str] = []
    cluster_spec = _parse_json(environ, "CLUSTER_SPEC", warnings)
    tf_config = _parse_json(environ, "TF_CONFIG", warnings)
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


def _parse_json(environ: Mapping[str, str], name: str, warnings: list[str]) -> dict[str, Any] | None:
    text = environ.get(name)
    if text is None:
        return None
    try:
        value = json.loads(text)
    except ValueError as err:
        warnings.append(f"{name} is not valid JSON ({err}): {text[:80]!r}")
        return None
    if not isinstance(value, dict):
        warnings.append(f"{name} must be a JSON object, got {type(value).__name__}")
        return None
    if not isinstance(value.get("cluster", {}), dict) or not isinstance(value.get("task", {}), dict):
        warnings.append(f"{name}: 'cluster' and 'task' must be JSON objects")
        return None
    return value


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

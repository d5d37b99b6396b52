"""Checks of the runtime contract for common mistakes, as shown by ``vertexrt info`` and ``vertexrt doctor``.

Example:
    >>> for warning in vertexrt.diagnostics.contract_warnings():
    ...     print("warning:", warning)
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from vertexrt.errors import ConfigError


def contract_warnings(environ: Mapping[str, str] | None = None) -> list[str]:
    """Human-readable warnings about the contract this process sees (empty when all is well).

    Malformed or disagreeing ``CLUSTER_SPEC``/``TF_CONFIG`` are reported by
    :func:`vertexrt.distributed.cluster`; these are the output-directory and project checks.
    """
    from vertexrt.env import project_id

    warnings = output_dir_warnings(environ)
    try:
        project_id()
    except ConfigError as err:
        warnings.append(f"project not resolvable: {err}")
    return warnings


def output_dir_warnings(environ: Mapping[str, str] | None = None) -> list[str]:
    """Warnings about ``AIP_*_DIR`` inside a Vertex job: unset, or not on Cloud Storage (lost at the end).

    A ``vertexrt local-run`` simulation (``VERTEXRT_LOCAL_RUN``) keeps its outputs on this machine on
    purpose: nothing is lost, so nothing is said.

    Example:
        >>> output_dir_warnings({"CLOUD_ML_JOB_ID": "1", "AIP_MODEL_DIR": "/tmp/m"})[0][:30]
        "AIP_MODEL_DIR='/tmp/m' is neit"
    """
    from vertexrt.paths import redact

    environ = os.environ if environ is None else environ
    on_vertex = bool(environ.get("CLOUD_ML_JOB_ID") or environ.get("CLUSTER_SPEC"))
    if not on_vertex or environ.get("VERTEXRT_LOCAL_RUN"):
        return []
    warnings: list[str] = []
    for name in ("AIP_MODEL_DIR", "AIP_CHECKPOINT_DIR", "AIP_TENSORBOARD_LOG_DIR"):
        value = environ.get(name)
        if value is not None and not value.strip().startswith(("gs://", "/gcs/")):
            warnings.append(
                f"{name}={redact(value)!r} is neither a gs:// URI nor a /gcs/ path: on Vertex anything "
                "else is lost when the job ends"
            )
        elif value is None:
            warnings.append(
                f"{name} is not set (the job has no baseOutputDirectory): outputs fall back to the "
                "container's disk and are lost when the job ends"
            )
    return warnings

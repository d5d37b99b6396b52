"""Checks of the runtime contract for common mistakes, as shown by ``vertexrt info``.

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
    environ = os.environ if environ is None else environ
    warnings: list[str] = []
    on_vertex = bool(environ.get("CLOUD_ML_JOB_ID") or environ.get("CLUSTER_SPEC"))
    if on_vertex:
        for name in ("AIP_MODEL_DIR", "AIP_CHECKPOINT_DIR", "AIP_TENSORBOARD_LOG_DIR"):
            value = environ.get(name)
            if value is not None and not value.strip().startswith(("gs://", "/gcs/")):
                warnings.append(
                    f"{name}={value!r} is neither a gs:// URI nor a /gcs/ path: on Vertex anything else is "
                    "lost when the job ends"
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

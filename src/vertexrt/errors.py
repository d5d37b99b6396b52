"""The typed errors vertexrt raises.

Every error names what was wrong and where (the variable, file, tree path or byte offset) and,
where it can, what would fix it.

Example:
    >>> try:
    ...     raise ConfigError("AIP_MODEL_DIR='model/' is not a gs:// URI or an absolute path")
    ... except VertexrtError as err:
    ...     print(err)
    AIP_MODEL_DIR='model/' is not a gs:// URI or an absolute path
"""

from __future__ import annotations


class VertexrtError(Exception):
    """Base class of every error raised by vertexrt."""


class ConfigError(VertexrtError, ValueError):
    """The platform contract (environment variables, arguments) is missing or malformed."""


class ClusterSpecError(ConfigError):
    """CLUSTER_SPEC, TF_CONFIG or MASTER_*/RANK/WORLD_SIZE is malformed or inconsistent."""


class PathError(VertexrtError, ValueError):
    """A path or URI cannot be used: bad bucket name, '..' segment, empty object name."""


class DataError(VertexrtError):
    """A data file or table is malformed, unreadable or empty."""


class MetricError(VertexrtError, ValueError):
    """A reported metric value is NaN, infinite or not a number."""


class CheckpointError(VertexrtError):
    """A checkpoint cannot be written, committed, verified or restored."""

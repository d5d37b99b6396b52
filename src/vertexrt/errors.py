"""The typed errors and warnings vertexrt raises: every one of them lives here.

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


class PreflightError(ConfigError):
    """The startup checks (``vertexrt doctor``) found problems that would stop the job, each with its fix."""


class RendezvousTimeout(ConfigError):
    """The rendezvous deadline passed before the chief answered or every peer joined."""


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


class CheckpointCorruptError(CheckpointError):
    """A committed checkpoint failed verification (checksum, size, missing file or unreadable manifest).

    ``file`` names the data file or manifest that failed, when one did.
    """

    def __init__(self, message: str, *, file: str | None = None) -> None:
        super().__init__(message)
        self.file = file


class StepExistsError(CheckpointError):
    """``save()`` of a step that is already committed (pass ``overwrite=True`` to replace it atomically)."""


class StorageError(CheckpointError):
    """Storage did not answer, or kept failing, within the deadline; ``operation`` and ``uri`` say where."""

    def __init__(self, message: str, operation: str, uri: str) -> None:
        super().__init__(message)
        self.operation = operation
        self.uri = uri

    def __reduce__(self) -> tuple[type[StorageError], tuple[str, str, str]]:
        # picklable, so it crosses process boundaries (torch.distributed.checkpoint gathers rank errors)
        return (type(self), (str(self), self.operation, self.uri))


class VertexrtWarning(UserWarning):
    """Base class of every warning vertexrt issues (``-W ignore::vertexrt.VertexrtWarning``)."""


class ClusterSpecWarning(VertexrtWarning):
    """Two cluster variables (CLUSTER_SPEC, TF_CONFIG, RANK/WORLD_SIZE) describe the job differently."""

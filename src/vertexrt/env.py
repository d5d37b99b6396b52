"""The Vertex AI runtime contract, read from the environment and the command line when asked.

Nothing is cached: every call reads ``os.environ`` and ``sys.argv`` again, so tests can patch them.

Example:
    >>> import vertexrt
    >>> env = vertexrt.environment()
    >>> env.model_dir            # AIP_MODEL_DIR on Vertex, ./vertexrt_output/local/model elsewhere
    '...'
    >>> client = vertexrt.bigquery_client()   # bound to CLOUD_ML_PROJECT_ID, never the tenant project
"""

from __future__ import annotations

import os
import sys

from vertexrt.errors import ConfigError

# Kept off the import path on purpose: `typing`, `dataclasses` and `json` cost ~15 ms at import.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Mapping, Sequence
    from typing import Any

    from google.cloud import bigquery

#: The variables of the platform contract, shown by ``vertexrt info``.
CONTRACT_VARIABLES = (
    "CLOUD_ML_PROJECT_ID",
    "CLOUD_ML_REGION",
    "CLOUD_ML_JOB_ID",
    "CLOUD_ML_TRIAL_ID",
    "CLOUD_ML_HP_METRIC_FILE",
    "CLOUD_ML_HP_METRIC_TAG",
    "AIP_MODEL_DIR",
    "AIP_CHECKPOINT_DIR",
    "AIP_TENSORBOARD_LOG_DIR",
    "AIP_DATA_FORMAT",
    "AIP_TRAINING_DATA_URI",
    "AIP_VALIDATION_DATA_URI",
    "AIP_TEST_DATA_URI",
    "CLUSTER_SPEC",
    "TF_CONFIG",
    "MASTER_ADDR",
    "MASTER_PORT",
    "WORLD_SIZE",
    "RANK",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "GROUP_WORLD_SIZE",
    "TORCHELASTIC_RUN_ID",
    "VERTEXRT_WORKERPOOL2",
    "VERTEXRT_LOCAL_RUN",
    "GOOGLE_CLOUD_PROJECT",
    "CLOUDSDK_CORE_PROJECT",
    "STORAGE_EMULATOR_HOST",
    "BIGQUERY_EMULATOR_HOST",
    "VERTEXRT_LOCAL_DIR",
    "VERTEXRT_FUSE_ROOT",
)

_OUTPUT_DIRS = {
    "model": "AIP_MODEL_DIR",
    "checkpoints": "AIP_CHECKPOINT_DIR",
    "logs": "AIP_TENSORBOARD_LOG_DIR",
}
_DATA_URIS = {
    "training": "AIP_TRAINING_DATA_URI",
    "validation": "AIP_VALIDATION_DATA_URI",
    "test": "AIP_TEST_DATA_URI",
}


_FIELDS = (
    "platform",
    "project",
    "region",
    "job_id",
    "trial_id",
    "model_dir",
    "checkpoint_dir",
    "tensorboard_log_dir",
    "training_data_uri",
    "validation_data_uri",
    "test_data_uri",
    "data_format",
    "job_dir",
    "variables",
)


class Environment:
    """A frozen snapshot of what the platform told this process.

    Directories are never ``None``: when the ``AIP_*`` variable is absent they fall back to the same
    layout under ``--job-dir`` (legacy AI Platform) or a local base directory, trial-scoped as Vertex does.
    They carry no trailing slash.
    """

    __slots__ = _FIELDS
    platform: str  # "vertex", "ai-platform" (legacy) or "local"
    project: str | None
    region: str | None
    job_id: str | None
    trial_id: str | None
    model_dir: str
    checkpoint_dir: str
    tensorboard_log_dir: str
    training_data_uri: str | None
    validation_data_uri: str | None
    test_data_uri: str | None
    data_format: str | None
    job_dir: str | None
    variables: Mapping[str, str]  # the raw contract variables present

    def __init__(self, **values: Any) -> None:
        unknown, missing = set(values) - set(_FIELDS), set(_FIELDS) - set(values)
        if unknown or missing:
            raise TypeError(f"Environment fields: unknown {sorted(unknown)}, missing {sorted(missing)}")
        for name in _FIELDS:
            object.__setattr__(self, name, values[name])

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError(f"Environment is frozen: cannot set {name!r}")

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Environment) and self.as_dict() == other.as_dict()

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        shown = ", ".join(f"{name}={getattr(self, name)!r}" for name in _FIELDS if name != "variables")
        return f"Environment({shown})"

    @property
    def on_vertex(self) -> bool:
        """True inside a Vertex AI (or legacy AI Platform) training job."""
        return self.platform != "local"

    def as_dict(self) -> dict[str, Any]:
        """The fields as a plain dict (``variables`` included)."""
        return {name: getattr(self, name) for name in _FIELDS}


def environment() -> Environment:
    """Read the runtime contract now.

    Raises:
        ConfigError: a variable is present but malformed (empty, relative path, bad URI); the message
            names the variable and its value.
    """
    environ = os.environ
    job_id = _optional(environ, "CLOUD_ML_JOB_ID")
    trial_id = _trial_id(environ)
    job_dir = job_dir_from_argv(sys.argv[1:])
    base = _fallback_base(job_id, trial_id, job_dir)
    dirs = {name: _directory(environ, var) or _local_join(base, name) for name, var in _OUTPUT_DIRS.items()}
    uris = {name: _optional(environ, var) for name, var in _DATA_URIS.items()}
    return Environment(
        platform=_platform(environ),
        project=_project_from_environ(environ),
        region=_optional(environ, "CLOUD_ML_REGION") or _optional(environ, "GOOGLE_CLOUD_REGION"),
        job_id=job_id,
        trial_id=trial_id,
        model_dir=dirs["model"],
        checkpoint_dir=dirs["checkpoints"],
        tensorboard_log_dir=dirs["logs"],
        training_data_uri=uris["training"],
        validation_data_uri=uris["validation"],
        test_data_uri=uris["test"],
        data_format=_data_format(environ),
        job_dir=job_dir,
        variables={name: environ[name] for name in CONTRACT_VARIABLES if name in environ},
    )


def project_id(explicit: str | None = None) -> str:
    """Resolve the Google Cloud project the job's clients must use.

    Order: ``explicit`` > ``CLOUD_ML_PROJECT_ID`` (a project *number* on Vertex) > off Vertex only:
    ``GOOGLE_CLOUD_PROJECT``, ``CLOUDSDK_CORE_PROJECT``, ``google.auth.default()``. On Vertex it never
    falls back to Application Default Credentials: they name a Google-managed tenant project.

    Example:
        >>> vertexrt.project_id()          # '123456789012' inside a Vertex job
    """
    if explicit is not None:
        if not str(explicit).strip():
            raise ConfigError("project_id(explicit=...) is empty: pass a project ID or number, or None")
        return str(explicit).strip()
    environ = os.environ
    resolved = _project_from_environ(environ)
    if resolved:
        return resolved
    if _platform(environ) != "local":
        raise ConfigError(
            "CLOUD_ML_PROJECT_ID is not set inside a Vertex job, and the project cannot be taken from the "
            "VM's credentials (they name a Google-managed tenant project). Pass project=... explicitly."
        )
    try:
        import google.auth
        from google.auth.exceptions import DefaultCredentialsError

        try:
            _, adc_project = google.auth.default()
        except DefaultCredentialsError:
            adc_project = None
    except ImportError:  # pragma: no cover - google-auth is a core dependency
        adc_project = None
    if adc_project:
        return str(adc_project)
    raise ConfigError(
        "no Google Cloud project could be resolved: set GOOGLE_CLOUD_PROJECT (or CLOUD_ML_PROJECT_ID), "
        "run `gcloud config set project ...`, or pass project=... explicitly"
    )


def storage_options(project: str | None = None) -> dict[str, Any]:
    """Keyword arguments for ``gcsfs.GCSFileSystem`` bound to the resolved project.

    With ``STORAGE_EMULATOR_HOST`` set they point at the emulator with anonymous credentials.

    Example:
        >>> fs = gcsfs.GCSFileSystem(**vertexrt.storage_options())
    """
    options: dict[str, Any] = {}
    resolved = project or _project_from_environ(os.environ)
    if resolved:
        options["project"] = resolved
    emulator = emulator_endpoint()
    if emulator:
        options["endpoint_url"] = emulator
        options["token"] = "anon"
    return options


def emulator_endpoint() -> str | None:
    """``STORAGE_EMULATOR_HOST`` with its scheme (``http://`` added if missing), or None."""
    host = os.environ.get("STORAGE_EMULATOR_HOST", "").strip()
    if not host or host == "default":
        return None
    return host if host.startswith(("http://", "https://")) else f"http://{host}"


def bigquery_client(project: str | None = None, **kwargs: Any) -> bigquery.Client:
    """A ``google.cloud.bigquery.Client`` bound to :func:`project_id`.

    ``BIGQUERY_EMULATOR_HOST`` (``http://host:port``) points it at a local server with anonymous
    credentials.

    Example:
        >>> rows = vertexrt.bigquery_client().query("SELECT 1").result()
    """
    from google.cloud import bigquery

    emulator = os.environ.get("BIGQUERY_EMULATOR_HOST", "").strip()
    if emulator:
        from google.auth.credentials import AnonymousCredentials

        endpoint = emulator if emulator.startswith(("http://", "https://")) else f"http://{emulator}"
        kwargs.setdefault("client_options", {"api_endpoint": endpoint})
        kwargs.setdefault("credentials", AnonymousCredentials())
    return bigquery.Client(project=project_id(project), **kwargs)


def job_dir_from_argv(argv: Sequence[str]) -> str | None:
    """The legacy AI Platform ``--job-dir`` (or ``--job_dir``) value in ``argv``, validated."""
    for index, token in enumerate(argv):
        for flag in ("--job-dir", "--job_dir"):
            if token == flag:
                if index + 1 >= len(argv):
                    raise ConfigError(f"{flag} is given without a value on the command line")
                return _validated_location(flag, argv[index + 1])
            if token.startswith(flag + "="):
                return _validated_location(flag, token[len(flag) + 1 :])
    return None


def _platform(environ: Mapping[str, str]) -> str:
    if environ.get("CLOUD_ML_JOB_ID") or environ.get("CLUSTER_SPEC"):
        return "vertex"
    tf_config = _lenient_json(environ.get("TF_CONFIG"))
    if tf_config.get("environment") == "cloud" or "master" in (tf_config.get("cluster") or {}):
        return "ai-platform"
    return "local"


def _project_from_environ(environ: Mapping[str, str]) -> str | None:
    if "CLOUD_ML_PROJECT_ID" in environ:
        value = environ["CLOUD_ML_PROJECT_ID"].strip()
        if not value:
            raise ConfigError(
                "CLOUD_ML_PROJECT_ID is set but empty: unset it or give the project number, e.g. 123456789012"
            )
        return value
    if _platform(environ) != "local":
        return None
    for name in ("GOOGLE_CLOUD_PROJECT", "CLOUDSDK_CORE_PROJECT"):
        value = environ.get(name, "").strip()
        if value:
            return value
    return None


def _trial_id(environ: Mapping[str, str]) -> str | None:
    trial = environ.get("CLOUD_ML_TRIAL_ID", "").strip()
    if trial:
        return trial
    for name in ("CLUSTER_SPEC", "TF_CONFIG"):
        task = _lenient_json(environ.get(name)).get("task")
        if isinstance(task, dict) and str(task.get("trial") or "").strip():
            return str(task["trial"]).strip()
    return None


def _data_format(environ: Mapping[str, str]) -> str | None:
    value = _optional(environ, "AIP_DATA_FORMAT")
    return value.lower() if value else None


def _optional(environ: Mapping[str, str], name: str) -> str | None:
    if name not in environ:
        return None
    value = environ[name].strip()
    if not value:
        raise ConfigError(f"{name} is set but empty: unset it or give it a value")
    return value


def _directory(environ: Mapping[str, str], name: str) -> str | None:
    value = _optional(environ, name)
    return None if value is None else _validated_location(name, value)


def _validated_location(name: str, value: str) -> str:
    """A gs:// URI or an absolute path, without its trailing slash."""
    from vertexrt import paths
    from vertexrt.errors import PathError

    value = value.strip()
    if not value:
        raise ConfigError(f"{name} is empty: give a gs:// URI or an absolute path")
    if paths.is_gcs(value):
        try:
            paths.split_gcs(value)
        except PathError as err:
            raise ConfigError(f"{name}={value!r} is not a valid gs:// URI: {err}") from None
    elif not value.startswith("/"):
        raise ConfigError(f"{name}={value!r} is neither a gs:// URI nor an absolute path")
    return value.rstrip("/") or "/"


def _fallback_base(job_id: str | None, trial_id: str | None, job_dir: str | None) -> str:
    local = os.environ.get("VERTEXRT_LOCAL_DIR")
    if job_dir:
        base = job_dir
    elif local is not None:
        if not local.strip():
            raise ConfigError("VERTEXRT_LOCAL_DIR is set but empty: unset it or give a directory")
        base = os.path.abspath(local.strip())
    else:
        base = os.path.abspath(os.path.join("vertexrt_output", job_id or "local"))
    return _local_join(base, trial_id) if trial_id else base


def _local_join(base: str, name: str) -> str:
    return base.rstrip("/") + "/" + name


def _lenient_json(text: str | None) -> dict[str, Any]:
    """JSON object or {} for anything absent or malformed (the cluster model reports those)."""
    if not text:
        return {}
    import json

    try:
        value = json.loads(text)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}

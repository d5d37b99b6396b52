"""The Vertex AI runtime contract, read from the environment and the command line when asked.

Nothing is cached: every call reads ``os.environ`` and ``sys.argv`` again, so tests can patch them.

Example:
    >>> import vertexrt
    >>> env = vertexrt.environment()
    >>> env.model_dir            # AIP_MODEL_DIR on Vertex, ./vertexrt_output/local/model elsewhere
    '...'
    >>> vertexrt.project_id()   # CLOUD_ML_PROJECT_ID on Vertex, never the VM's tenant project
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

#: Variables the platform sets for each job and replica. ``vertexrt local-run`` sets its own and drops these
#: (and any name under :data:`PLATFORM_PREFIXES`) from the environment it inherits: see
#: :func:`is_platform_variable`.
PLATFORM_VARIABLES = (
    "CLOUD_ML_PROJECT_ID",
    "CLOUD_ML_REGION",
    "CLOUD_ML_JOB_ID",
    "CLOUD_ML_TRIAL_ID",
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
    "VERTEXRT_LOCAL_RUN_ID",
)
PLATFORM_PREFIXES = ("AIP_", "CLOUD_ML_", "TORCHELASTIC_", "ROLE_")
#: Variables the user sets to configure vertexrt and the cloud clients (kept by ``local-run``).
SETTING_VARIABLES = (
    "CLOUD_ML_HP_METRIC_FILE",
    "CLOUD_ML_HP_METRIC_TAG",
    "GOOGLE_CLOUD_PROJECT",
    "CLOUDSDK_CORE_PROJECT",
    "GOOGLE_CLOUD_REGION",
    "GOOGLE_APPLICATION_CREDENTIALS",
    "STORAGE_EMULATOR_HOST",
    "BIGQUERY_EMULATOR_HOST",
    "VERTEXRT_LOCAL_DIR",
    "VERTEXRT_FUSE_ROOT",
    "VERTEXRT_PREFER_FUSE",
)
#: The variables of the contract, shown by ``vertexrt info``.
CONTRACT_VARIABLES = PLATFORM_VARIABLES + SETTING_VARIABLES

#: Exit codes Vertex treats as possibly transient: SIGABRT (6, or 134 from a custom container) and SIGSEGV
#: (11, or 139); it retries the whole job up to 3 times. Any other non-zero exit of the code is a "user code
#: exception", a permanent error that shuts the job down ("Understand the serverless training service",
#: https://cloud.google.com/vertex-ai/docs/training/understanding-training-service#common-errors).
TRANSIENT_EXIT_CODES = frozenset({6, 134, 11, 139})
#: The exit code of a replica that the crash-loop guard stops (:mod:`vertexrt.runtime.attempts`): permanent
#: on Vertex (not transient, below 128 so never read as a signal), and ``local-run`` does not restart it.
#: NVIDIA's resiliency extension exits 93 for the same reason (restarts that make no progress).
CRASH_LOOP_EXIT_CODE = 93

#: Longest accepted value of a scalar variable, and of a JSON one (CLUSTER_SPEC, TF_CONFIG).
MAX_VALUE_CHARS = 4096
MAX_JSON_CHARS = 1 << 20
_MAX_ID_CHARS = 128


def is_platform_variable(name: str) -> bool:
    """True for a variable the platform sets per job (a local launch must not inherit it).

    Example:
        >>> is_platform_variable("AIP_MODEL_DIR"), is_platform_variable("CLOUD_ML_HP_METRIC_FILE")
        (True, False)
    """
    if name in SETTING_VARIABLES:
        return False
    return name in PLATFORM_VARIABLES or name.startswith(PLATFORM_PREFIXES)


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
        """The fields, with credentials embedded in URIs masked (safe to log)."""
        from vertexrt.uris import redact

        def shown(value: object) -> str:
            return repr(redact(value) if isinstance(value, str) else value)

        fields = ", ".join(f"{name}={shown(getattr(self, name))}" for name in _FIELDS if name != "variables")
        return f"Environment({fields})"

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
    job_id = _path_segment("CLOUD_ML_JOB_ID", _optional(environ, "CLOUD_ML_JOB_ID"))
    trial_id = _trial_id(environ)
    job_dir = job_dir_from_argv(sys.argv[1:])
    base = _fallback_base(job_id, trial_id, job_dir)
    dirs = {name: _directory(environ, var) or _local_join(base, name) for name, var in _OUTPUT_DIRS.items()}
    uris = {name: _optional(environ, var) for name, var in _DATA_URIS.items()}
    return Environment(
        platform=_platform(environ),
        project=project_from_environ(environ),
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
    resolved = project_from_environ(environ)
    if resolved:
        return resolved
    if _platform(environ) != "local":
        raise ConfigError(
            "CLOUD_ML_PROJECT_ID is not set inside a Vertex job, and the project cannot be taken from the "
            "VM's credentials (they name a Google-managed tenant project). Pass project=... explicitly."
        )
    _check_credentials_file(environ)
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


def project_from_environ(environ: Mapping[str, str] | None = None) -> str | None:
    """The project named by the environment alone (no credentials lookup), or None.

    ``CLOUD_ML_PROJECT_ID``; off Vertex also ``GOOGLE_CLOUD_PROJECT`` then ``CLOUDSDK_CORE_PROJECT``.

    Example:
        >>> project_from_environ({"CLOUD_ML_PROJECT_ID": "123456789012"})
        '123456789012'
    """
    environ = os.environ if environ is None else environ
    if "CLOUD_ML_PROJECT_ID" in environ:
        value = _bounded("CLOUD_ML_PROJECT_ID", environ["CLOUD_ML_PROJECT_ID"]).strip()
        if not value:
            raise ConfigError(
                "CLOUD_ML_PROJECT_ID is set but empty: unset it or give the project number, e.g. 123456789012"
            )
        return value
    if _platform(environ) != "local":
        return None
    for name in ("GOOGLE_CLOUD_PROJECT", "CLOUDSDK_CORE_PROJECT"):
        value = _bounded(name, environ.get(name, "")).strip()
        if value:
            return value
    return None


def _check_credentials_file(environ: Mapping[str, str]) -> None:
    """``GOOGLE_APPLICATION_CREDENTIALS``, when set to an existing path, must be a JSON object file."""
    path = environ.get("GOOGLE_APPLICATION_CREDENTIALS", "").strip()
    if not path or not os.path.exists(path):
        return  # google.auth reports a missing file as "no credentials"
    fix = "point it at a service-account key or ADC JSON file, or unset it"
    if not os.path.isfile(path):
        raise ConfigError(f"GOOGLE_APPLICATION_CREDENTIALS={path!r} is not a regular file: {fix}")
    if os.path.getsize(path) > MAX_JSON_CHARS:
        raise ConfigError(f"GOOGLE_APPLICATION_CREDENTIALS={path!r} is over {MAX_JSON_CHARS} bytes: {fix}")
    with open(path, "rb") as handle:
        doc = _json_object(handle.read().decode("utf-8", "replace"))
    if doc is None:
        raise ConfigError(f"GOOGLE_APPLICATION_CREDENTIALS={path!r} does not hold a JSON object: {fix}")


def _trial_id(environ: Mapping[str, str]) -> str | None:
    trial = _bounded("CLOUD_ML_TRIAL_ID", environ.get("CLOUD_ML_TRIAL_ID", "")).strip()
    if trial:
        return _path_segment("CLOUD_ML_TRIAL_ID", trial)
    for name in ("CLUSTER_SPEC", "TF_CONFIG"):
        task = _lenient_json(environ.get(name)).get("task")
        if (
            isinstance(task, dict)
            and isinstance(task.get("trial"), (str, int))
            and str(task["trial"]).strip()
        ):
            return _path_segment(f"{name} task.trial", str(task["trial"]).strip())
    return None


def _path_segment(name: str, value: str | None) -> str | None:
    """An ID that becomes one directory name of the local output layout: no ``/``, ``..`` or control bytes."""
    if value is None:
        return None
    if (
        len(value) > _MAX_ID_CHARS
        or value in (".", "..")
        or not all(c.isalnum() or c in "._-" for c in value)
        or not value.isascii()
    ):
        shown = value if len(value) <= 80 else value[:80] + "..."
        raise ConfigError(
            f"{name}={shown!r} cannot name an output directory: use at most {_MAX_ID_CHARS} ASCII letters, "
            "digits, '.', '_' or '-' (not '.' or '..')"
        )
    return value


def _data_format(environ: Mapping[str, str]) -> str | None:
    value = _optional(environ, "AIP_DATA_FORMAT")
    return value.lower() if value else None


def _bounded(name: str, value: str) -> str:
    if len(value) > MAX_VALUE_CHARS:
        raise ConfigError(
            f"{name} is {len(value)} characters long (at most {MAX_VALUE_CHARS}): check its value"
        )
    return value


def _optional(environ: Mapping[str, str], name: str) -> str | None:
    if name not in environ:
        return None
    value = _bounded(name, environ[name]).strip()
    if not value:
        raise ConfigError(f"{name} is set but empty: unset it or give it a value")
    return value


def _directory(environ: Mapping[str, str], name: str) -> str | None:
    value = _optional(environ, name)
    return None if value is None else _validated_location(name, value)


def _validated_location(name: str, value: str) -> str:
    """A gs:// URI, a valid /gcs/ path or an absolute path, without its trailing slash."""
    from vertexrt import uris
    from vertexrt.errors import PathError

    value = _bounded(name, value).strip()
    if not value:
        raise ConfigError(f"{name} is empty: give a gs:// URI or an absolute path")
    try:
        uris.check_text(value)
        if uris.is_gcs(value) or uris.is_fuse(value):
            uris.split(value)
    except PathError as err:
        raise ConfigError(f"{name} is not a usable location: {err}") from None
    if not (uris.is_gcs(value) or value.startswith("/")):
        raise ConfigError(f"{name}={uris.redact(value)!r} is neither a gs:// URI nor an absolute path")
    return value.rstrip("/") or "/"


def _fallback_base(job_id: str | None, trial_id: str | None, job_dir: str | None) -> str:
    local = os.environ.get("VERTEXRT_LOCAL_DIR")
    if job_dir:
        base = job_dir
    elif local is not None:
        local = _bounded("VERTEXRT_LOCAL_DIR", local).strip()
        if not local:
            raise ConfigError("VERTEXRT_LOCAL_DIR is set but empty: unset it or give a directory")
        base = os.path.abspath(local)
    else:
        base = os.path.abspath(os.path.join("vertexrt_output", job_id or "local"))
    return _local_join(base, trial_id) if trial_id else base


def _local_join(base: str, name: str) -> str:
    return base.rstrip("/") + "/" + name


def _lenient_json(text: str | None) -> dict[str, Any]:
    """The JSON object in ``text``, or {} for anything absent, malformed, too long or nested too deep.

    The cluster model reports malformed values with a typed error; the environment only peeks at them.
    """
    return _json_object(text) or {}


def _json_object(text: str | None) -> dict[str, Any] | None:
    if not text or len(text) > MAX_JSON_CHARS:
        return None
    import json

    try:
        value = json.loads(text)
    except (ValueError, RecursionError):
        return None
    return value if isinstance(value, dict) else None

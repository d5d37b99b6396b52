"""Preflight checks of a job: ``vertexrt doctor`` and the startup check of ``@main`` / ``Trainer.fit``.

Every check runs in its own daemon thread under one global deadline: a check that does not answer in time
becomes a finding ("did not answer within N s"), never a hang. A :class:`Finding` has a severity
(``fatal``: the job cannot succeed; ``warning``; ``ok``), what was seen, and the fix.

Checks: the output directories are writable (a probe object is written and deleted through
:mod:`vertexrt.paths`); the ``/gcs`` mount serves each bucket used through a ``/gcs/`` path (and, inside a
real Vertex job, each bucket used); credentials and the project; the ``AIP_*_DATA_URI`` inputs exist; the
GPUs visible vs the processes on the node; ``/dev/shm`` size for DataLoader workers; free local disk vs the
last checkpoint; NCCL variables that contradict each other.

The same module holds the quick checks of the runtime contract that ``vertexrt info`` (and ``@main``, on
Vertex) print as warnings, without threads or probes: :func:`contract_warnings`.

Example:
    >>> from vertexrt import doctor
    >>> findings = doctor.preflight(timeout=5.0)   # logs warnings once, raises PreflightError on fatal ones
    >>> print(doctor.render(doctor.check()))
"""

from __future__ import annotations

import logging
import os
import re
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, Literal

from vertexrt.errors import ConfigError, PreflightError, VertexrtError

if TYPE_CHECKING:
    from vertexrt.distributed import Cluster
    from vertexrt.env import Environment

log = logging.getLogger(__name__)

Severity = Literal["fatal", "warning", "ok"]
Check = Callable[[], "list[Finding]"]

#: Below this ``/dev/shm`` size DataLoader workers crash ("bus error", Docker's default is 64 MiB).
MIN_SHM_BYTES = 1 << 30
_OUTPUTS = (
    ("model_dir", "AIP_MODEL_DIR"),
    ("checkpoint_dir", "AIP_CHECKPOINT_DIR"),
    ("tensorboard_log_dir", "AIP_TENSORBOARD_LOG_DIR"),
)
_INPUTS = (
    ("training_data_uri", "AIP_TRAINING_DATA_URI"),
    ("validation_data_uri", "AIP_VALIDATION_DATA_URI"),
    ("test_data_uri", "AIP_TEST_DATA_URI"),
)
_STEP = re.compile(r"step_(\d+)")  # the checkpoint step directories (vertexrt.checkpoint.storage.step_name)
_logged: set[tuple[str, str]] = set()


@dataclass(frozen=True)
class Finding:
    """One result of a check: ``severity``, the ``check`` that found it, ``what`` was seen and the ``fix``."""

    severity: Severity
    check: str
    what: str
    fix: str = ""

    def as_dict(self) -> dict[str, str]:
        return asdict(self)


def preflight(
    env: Environment | None = None, cluster: Cluster | None = None, *, timeout: float = 5.0
) -> list[Finding]:
    """Run :func:`check`; log each warning once per process; stop the job on a fatal finding.

    Raises:
        PreflightError: one or more fatal findings; the message lists each with its fix.

    Example:
        >>> findings = preflight(timeout=5.0)
    """
    findings = check(env, cluster, timeout=timeout)
    for finding in findings:
        key = (finding.check, finding.what)
        if finding.severity == "warning" and key not in _logged:
            _logged.add(key)
            log.warning("preflight: %s: %s%s", finding.check, finding.what, _fix(finding))
    fatal = [f for f in findings if f.severity == "fatal"]
    if fatal:
        lines = "\n".join(f"  - {f.check}: {f.what}{_fix(f)}" for f in fatal)
        raise PreflightError(
            f"preflight found {len(fatal)} problem(s) that would stop this job, before training started:\n"
            f"{lines}\n(run `vertexrt doctor` for the full report; pass preflight=False to skip these checks)"
        )
    return findings


def check(
    env: Environment | None = None, cluster: Cluster | None = None, *, timeout: float = 5.0
) -> list[Finding]:
    """Every finding about this process's job, in a stable order; bounded by ``timeout`` seconds overall.

    Example:
        >>> [f.what for f in check() if f.severity == "fatal"]
        []
    """
    if env is None:
        from vertexrt.env import environment

        try:
            env = environment()
        except VertexrtError as err:
            return [Finding("fatal", "environment", str(err), "fix the variable named above")]
    processes = 1
    early: list[Finding] = []
    if cluster is None:
        from vertexrt.distributed import cluster as read_cluster

        try:
            cluster = read_cluster()
        except VertexrtError as err:
            early.append(Finding("fatal", "cluster", str(err), "fix the variable named above"))
    if cluster is not None:
        processes = cluster.local_world_size
    return early + run_checks(checks(env, processes), timeout)


def checks(env: Environment, processes_per_node: int = 1) -> dict[str, Check]:
    """The checks for ``env``, by name (each returns its findings)."""
    environ = dict(os.environ)
    simulated = bool(environ.get("VERTEXRT_LOCAL_RUN"))
    found: dict[str, Check] = {}
    seen: set[str] = set()
    for field, variable in _OUTPUTS:
        directory: str = getattr(env, field)
        label = variable if variable in env.variables else field
        if directory not in seen:
            seen.add(directory)
            found[f"output {label}"] = _bind(writable, label, directory)
    locations = [getattr(env, f) for f, _ in _OUTPUTS] + [getattr(env, f) for f, _ in _INPUTS]
    for bucket in _mounted_buckets(locations, all_buckets=env.on_vertex and not simulated):
        found[f"mount {bucket}"] = _bind(mount, bucket)
    found["contract"] = contract
    found["credentials"] = _bind(credentials, env, locations)
    for field, variable in _INPUTS:
        uri = getattr(env, field)
        if uri:
            found[f"data {variable}"] = _bind(data_exists, variable, uri)
    found["gpus"] = _bind(gpus, environ, processes_per_node)
    found["shm"] = _bind(shm, "/dev/shm", MIN_SHM_BYTES)
    found["disk"] = _bind(disk, env.checkpoint_dir)
    found["nccl"] = _bind(nccl, environ, _interfaces())
    return found


def run_checks(named: Mapping[str, Check], timeout: float) -> list[Finding]:
    """Run each check in a daemon thread; one that is not done after ``timeout`` s is a warning finding."""
    results: dict[str, list[Finding]] = {}
    done = threading.Condition()

    def target(name: str, fn: Check) -> None:
        try:
            out = fn()
        except Exception as err:  # noqa: BLE001 - a broken check is a finding, not a crash
            out = [Finding("warning", name, f"the check failed: {type(err).__name__}: {err}")]
        with done:
            results[name] = out
            done.notify_all()

    for name, fn in named.items():
        threading.Thread(target=target, args=(name, fn), name=f"vertexrt-doctor {name}", daemon=True).start()
    end = time.monotonic() + timeout
    with done:
        while len(results) < len(named) and (left := end - time.monotonic()) > 0:
            done.wait(left)
        answered = dict(results)
    findings: list[Finding] = []
    for name in named:
        findings += answered.get(name) or (
            []
            if name in answered
            else [
                Finding(
                    "warning",
                    name,
                    f"did not answer within {timeout:g} s",
                    "check the network, the bucket and the /gcs mount; `vertexrt doctor` shows the others",
                )
            ]
        )
    return findings


def render(findings: Sequence[Finding]) -> str:
    """The report ``vertexrt doctor`` prints: a summary line, then one line per finding (fixes indented)."""
    counts = {s: sum(f.severity == s for f in findings) for s in ("fatal", "warning", "ok")}
    lines = [f"vertexrt doctor: {counts['fatal']} fatal, {counts['warning']} warning(s), {counts['ok']} ok"]
    width = max((len(f.check) for f in findings), default=0)
    for f in sorted(findings, key=lambda f: ("fatal", "warning", "ok").index(f.severity)):
        lines.append(f"{f.severity.upper():<7}  {f.check:<{width}}  {f.what}")
        if f.fix and f.severity != "ok":
            lines.append(f"{'':<7}  {'':<{width}}  fix: {f.fix}")
    return "\n".join(lines)


# -- the checks -------------------------------------------------------------------------------------------


def writable(label: str, directory: str) -> list[Finding]:
    """Write and delete a probe object in ``directory`` through :mod:`vertexrt.paths`."""
    import socket
    import uuid

    from vertexrt import paths

    shown = f"{label}={paths.redact(directory)}"
    probe = paths.join(
        directory, f".vertexrt-doctor-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    )
    try:
        with paths.open(probe, "wb") as handle:
            handle.write(b"vertexrt doctor probe; safe to delete\n")
    except Exception as err:  # noqa: BLE001 - any failure to write is the finding
        if paths.storage_kind(directory) == "local":
            fix = (
                f"make {directory} writable, or point {label} (or VERTEXRT_LOCAL_DIR) at a writable directory"
            )
        else:
            bucket = paths.split_gcs(paths.to_gcs(directory))[0]
            fix = (
                f"check that bucket gs://{bucket} exists and that the job's service account may create and "
                f"delete objects in it (roles/storage.objectAdmin), or point {label} at another bucket"
            )
        why = "the bucket does not exist" if isinstance(err, FileNotFoundError) and fix[:5] == "check" else ""
        detail = why or f"{type(err).__name__}: {paths.redact(str(err))[:300]}"
        return [Finding("fatal", f"output {label}", f"{shown} is not writable: {detail}", fix)]
    try:
        fs, path = paths.filesystem(probe)
        fs.rm(path)
    except Exception as err:  # noqa: BLE001 - written but not deleted: writable, and the probe is left
        return [
            Finding(
                "warning",
                f"output {label}",
                f"{shown} is writable, but the probe {paths.redact(probe)} could not be deleted: "
                f"{type(err).__name__}: {paths.redact(str(err))[:300]}",
                "delete the probe by hand; checkpoint retention (KeepLast) and overwrite=True also need "
                "permission to delete there",
            )
        ]
    return [Finding("ok", f"output {label}", f"{shown} is writable")]


def contract() -> list[Finding]:
    """The output-directory warnings of ``vertexrt info`` (:func:`output_dir_warnings`), as findings."""
    return [Finding("warning", "contract", text) for text in output_dir_warnings()]


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


def mount(bucket: str) -> list[Finding]:
    """The ``/gcs`` mount serves ``bucket``: its directory exists and answers a listing."""
    from vertexrt import paths

    where = os.path.join(paths.fuse_root(), bucket)
    if not os.path.isdir(where):
        return [
            Finding(
                "warning",
                f"mount {bucket}",
                f"the Cloud Storage FUSE mount has no {where}: vertexrt falls back to the Cloud Storage API, "
                f"but plain open()/torch.save on /gcs/{bucket}/... will fail",
                f"check that the job's service account can read gs://{bucket} (Vertex mounts every bucket it "
                "can), or use gs:// URIs through vertexrt.paths",
            )
        ]
    try:
        os.listdir(where)
    except OSError as err:
        return [
            Finding(
                "warning",
                f"mount {bucket}",
                f"{where} does not answer: {err}",
                "the FUSE mount is broken (e.g. 'Transport endpoint is not connected'): restart the job",
            )
        ]
    return [Finding("ok", f"mount {bucket}", f"{where} is mounted and answers")]


def credentials(env: Environment, locations: Sequence[str | None]) -> list[Finding]:
    """The project is resolvable and, where Cloud Storage is reached through the API, credentials exist."""
    from vertexrt.clients import emulator_endpoint
    from vertexrt.env import project_from_environ

    findings: list[Finding] = []
    try:
        project = project_from_environ()
    except ConfigError as err:
        return [Finding("fatal", "project", str(err), "fix the variable named above")]
    if env.on_vertex and not project:
        findings.append(
            Finding(
                "warning",
                "project",
                "CLOUD_ML_PROJECT_ID is not set inside a Vertex job: clients cannot be bound to the project",
                "pass project=... to the clients explicitly",
            )
        )
    cloud = [loc for loc in locations if loc and (loc.startswith(("gs://", "/gcs/")))]
    if emulator_endpoint():
        return findings + [
            Finding("ok", "credentials", "STORAGE_EMULATOR_HOST is set: anonymous credentials")
        ]
    if not cloud and not env.on_vertex:
        return findings + ([Finding("ok", "project", f"project {project}")] if project else [])
    import google.auth
    from google.auth.exceptions import DefaultCredentialsError

    try:
        _, adc_project = google.auth.default()
    except DefaultCredentialsError as err:
        return findings + [
            Finding(
                "fatal" if not env.on_vertex else "warning",
                "credentials",
                f"no Google Cloud credentials: {err}",
                "run `gcloud auth application-default login` or set GOOGLE_APPLICATION_CREDENTIALS",
            )
        ]
    project = project or adc_project
    findings.append(Finding("ok", "credentials", "Application Default Credentials found"))
    if not project:
        findings.append(
            Finding(
                "warning",
                "project",
                "no Google Cloud project could be resolved",
                "set GOOGLE_CLOUD_PROJECT or run `gcloud config set project ...`",
            )
        )
    return findings


def data_exists(variable: str, uri: str) -> list[Finding]:
    """``uri`` (a file, a directory/prefix or a glob) names at least one object; ``bq://`` is not checked."""
    from vertexrt import paths

    shown = f"{variable}={paths.redact(uri)}"
    if uri.startswith("bq://"):
        return [Finding("ok", f"data {variable}", f"{shown} is a BigQuery table (not checked)")]
    try:
        fs, path = paths.filesystem(uri)
        if any(c in path for c in "*?["):
            first = next(iter(fs.glob(path)), None)
        else:
            first = path if fs.exists(path) else None
    except VertexrtError as err:
        return [Finding("fatal", f"data {variable}", str(err), f"fix {variable}")]
    except OSError as err:
        first, error = None, f": {type(err).__name__}: {paths.redact(str(err))[:300]}"
    else:
        error = ""
    if first is None:
        return [
            Finding(
                "fatal",
                f"data {variable}",
                f"{shown} matches no file or object{error}",
                f"check the dataset's location and that the job's service account can list it, or fix "
                f"{variable}",
            )
        ]
    return [Finding("ok", f"data {variable}", f"{shown} exists")]


def gpus(environ: Mapping[str, str], processes_per_node: int) -> list[Finding]:
    """GPUs visible (``nvidia-smi``, ``CUDA_VISIBLE_DEVICES``, torch if imported) vs processes per node."""
    import shutil
    import subprocess
    import sys

    from vertexrt import devices

    raw = environ.get("CUDA_VISIBLE_DEVICES")
    findings: list[Finding] = []
    listed = [t.strip() for t in raw.split(",") if t.strip()] if raw is not None else None
    tokens = devices.visible_devices(raw)
    if listed is not None and tokens is not None and len(tokens) < len(listed) and listed != ["-1"]:
        findings.append(
            Finding(
                "warning",
                "gpus",
                f"CUDA_VISIBLE_DEVICES={raw!r}: CUDA stops at the invalid entry {listed[len(tokens)]!r}, "
                f"so only {len(tokens)} GPU(s) are visible",
                "list GPU indexes or GPU-/MIG- UUIDs separated by commas, or unset it",
            )
        )
    smi = shutil.which("nvidia-smi")
    visible: list[Any] = []
    if smi:
        query = [smi, "--query-gpu=index,uuid,name,memory.total", "--format=csv,noheader,nounits"]
        out = subprocess.run(query, capture_output=True, text=True, timeout=20, check=False)
        visible = devices.filter_visible(devices.parse_nvidia_smi(out.stdout), raw)
        if tokens and len(visible) < len(tokens):
            findings.append(
                Finding(
                    "warning",
                    "gpus",
                    f"CUDA_VISIBLE_DEVICES={raw!r} lists {len(tokens)} GPU(s) but only {len(visible)} of "
                    "them exist on this machine",
                    "list only GPUs nvidia-smi shows, or unset CUDA_VISIBLE_DEVICES",
                )
            )
    count = len(visible)
    if "torch" in sys.modules:
        torch_count = int(sys.modules["torch"].cuda.device_count())
        if count and not torch_count:
            findings.append(
                Finding(
                    "warning",
                    "gpus",
                    f"nvidia-smi shows {count} GPU(s) but torch sees none: training would run on the CPU",
                    "install a CUDA build of torch that matches the driver (the CPU wheel is a common "
                    "mistake)",
                )
            )
        count = torch_count
    if count == 0:
        findings.append(Finding("ok", "gpus", "no GPU visible: training runs on the CPU"))
    elif processes_per_node > count:
        findings.append(
            Finding(
                "fatal",
                "gpus",
                f"{processes_per_node} processes on this node but only {count} visible GPU(s) "
                f"(CUDA_VISIBLE_DEVICES={raw or '<unset>'})",
                "start one process per GPU (torchrun --nproc-per-node=gpu, vertexrt local-run "
                "--processes-per-node N) or use a machine with more GPUs",
            )
        )
    elif count > processes_per_node:
        findings.append(
            Finding(
                "warning",
                "gpus",
                f"{count} GPUs are visible but this node runs {processes_per_node} training process(es): "
                f"unless one process drives them all (TF MirroredStrategy), {count - processes_per_node} "
                "stay idle",
                "start one process per GPU: torchrun --nproc-per-node=gpu or vertexrt.distributed.spawn(fn, "
                "nprocs='gpu')",
            )
        )
    else:
        findings.append(Finding("ok", "gpus", f"{count} GPU(s) for {processes_per_node} process(es)"))
    return findings


def shm(path: str = "/dev/shm", minimum: int = MIN_SHM_BYTES) -> list[Finding]:
    """``path`` (shared memory, where DataLoader workers pass batches) holds at least ``minimum`` bytes."""
    try:
        stat = os.statvfs(path)
    except OSError:
        return [
            Finding("warning", "shm", f"{path} is missing: DataLoader workers (num_workers > 0) will fail")
        ]
    size = stat.f_blocks * stat.f_frsize
    if size < minimum:
        return [
            Finding(
                "warning",
                "shm",
                f"{path} is {_size(size)} (under {_size(minimum)}): DataLoader workers crash with 'bus "
                "error' or 'No space left on device' once batches outgrow it",
                "use num_workers=0, or give the container more shared memory (docker run --shm-size=16g)",
            )
        ]
    return [Finding("ok", "shm", f"{path} is {_size(size)}")]


def disk(checkpoint_dir: str) -> list[Finding]:
    """Free space on a local checkpoint directory's disk vs the size of its last step."""
    from vertexrt import paths

    if paths.storage_kind(checkpoint_dir) != "local":
        return []
    fs, root = paths.filesystem(checkpoint_dir)
    steps = [] if not os.path.isdir(root) else [e for e in os.listdir(root) if _STEP.fullmatch(e)]
    existing = root
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    stat = os.statvfs(existing)
    free = stat.f_bavail * stat.f_frsize
    if not steps:
        return [Finding("ok", "disk", f"{_size(free)} free for checkpoints in {checkpoint_dir}")]
    last = max(steps, key=lambda name: int(name[len("step_") :]))
    size = int(fs.du(os.path.join(root, last)))
    if free < size:
        return [
            Finding(
                "fatal",
                "disk",
                f"{_size(free)} free on the disk of {checkpoint_dir}, but the last checkpoint {last} is "
                f"{_size(size)}: the next save cannot fit",
                "free disk space, keep fewer checkpoints (KeepLast), or checkpoint to a gs:// or /gcs/ path",
            )
        ]
    return [Finding("ok", "disk", f"{_size(free)} free for checkpoints of {_size(size)} ({last})")]


def nccl(environ: Mapping[str, str], interfaces: Sequence[str] | None = None) -> list[Finding]:
    """NCCL / torch NCCL variables that contradict each other or name what does not exist."""
    findings: list[Finding] = []

    def warn(what: str, fix: str) -> None:
        findings.append(Finding("warning", "nccl", what, fix))

    for new, old in (
        ("TORCH_NCCL_ASYNC_ERROR_HANDLING", "NCCL_ASYNC_ERROR_HANDLING"),
        ("TORCH_NCCL_BLOCKING_WAIT", "NCCL_BLOCKING_WAIT"),
    ):
        if new in environ and old in environ and environ[new].strip() != environ[old].strip():
            warn(
                f"{new}={environ[new]!r} and the deprecated {old}={environ[old]!r} disagree",
                f"unset {old}",
            )
    blocking = environ.get("TORCH_NCCL_BLOCKING_WAIT", environ.get("NCCL_BLOCKING_WAIT", "")).strip()
    handling = environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING", "").strip()
    if blocking == "1" and handling not in ("", "0"):
        warn(
            f"TORCH_NCCL_BLOCKING_WAIT=1 and TORCH_NCCL_ASYNC_ERROR_HANDLING={handling}: only one takes "
            "effect (blocking wait wins)",
            "unset TORCH_NCCL_BLOCKING_WAIT",
        )
    if environ.get("NCCL_IB_DISABLE", "").strip() == "1":
        for name in ("NCCL_IB_HCA", "NCCL_IB_GID_INDEX"):
            if environ.get(name):
                warn(f"NCCL_IB_DISABLE=1 but {name} is set: InfiniBand is off", "unset one of them")
        if environ.get("NCCL_NET", "").strip().upper() == "IB":
            warn("NCCL_IB_DISABLE=1 but NCCL_NET=IB: NCCL cannot initialise", "unset one of them")
    if environ.get("NCCL_P2P_DISABLE", "").strip() == "1" and environ.get("NCCL_P2P_LEVEL"):
        warn("NCCL_P2P_DISABLE=1 but NCCL_P2P_LEVEL is set: peer-to-peer is off", "unset one of them")
    debug = environ.get("NCCL_DEBUG")
    if debug is not None and debug.strip().upper() not in ("", "VERSION", "WARN", "INFO", "TRACE"):
        warn(f"NCCL_DEBUG={debug!r} is not a level NCCL knows", "use VERSION, WARN, INFO or TRACE")
    ifname = environ.get("NCCL_SOCKET_IFNAME", "").strip()
    if ifname and interfaces is not None and not ifname.startswith("^"):
        exact = ifname.startswith("=")
        wanted = [w.strip() for w in ifname.lstrip("=").split(",") if w.strip()]
        if not any(i == w if exact else i.startswith(w) for w in wanted for i in interfaces):
            warn(
                f"NCCL_SOCKET_IFNAME={ifname!r} matches no network interface of this machine "
                f"({', '.join(sorted(interfaces)) or 'none'}): NCCL cannot connect",
                "name an existing interface (e.g. eth0) or unset it",
            )
    return findings or [Finding("ok", "nccl", "no contradicting NCCL variables")]


# -- helpers ----------------------------------------------------------------------------------------------


def _bind(fn: Callable[..., list[Finding]], *args: Any) -> Check:
    return lambda: fn(*args)


def _fix(finding: Finding) -> str:
    return f" (fix: {finding.fix})" if finding.fix else ""


def _mounted_buckets(locations: Sequence[str | None], *, all_buckets: bool) -> list[str]:
    """Buckets named by ``/gcs/`` locations, plus (``all_buckets``) those named by ``gs://`` URIs."""
    from vertexrt import uris

    buckets: list[str] = []
    for location in locations:
        if not location or not (uris.is_fuse(location) or (all_buckets and uris.is_gcs(location))):
            continue
        try:
            bucket = uris.split(location)[0]
        except VertexrtError:
            continue  # the output or data check reports it
        if bucket not in buckets:
            buckets.append(bucket)
    return buckets


def _interfaces() -> list[str] | None:
    try:
        return os.listdir("/sys/class/net")
    except OSError:
        return None


def _size(n: int) -> str:
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{n} B"

"""``vertexrt local-run``: run a training command as an N-replica Vertex job on this machine.

Each replica gets the environment Vertex would give it: ``CLUSTER_SPEC`` (always), and on multi-replica jobs
``TF_CONFIG``, ``MASTER_ADDR``/``MASTER_PORT`` and node-level ``WORLD_SIZE``/``RANK``; ``AIP_MODEL_DIR``,
``AIP_CHECKPOINT_DIR``, ``AIP_TENSORBOARD_LOG_DIR`` under ``--base-output-dir`` (trial-scoped with
``--trial``); ``CLOUD_ML_JOB_ID``/``PROJECT_ID``/``REGION``/``TRIAL_ID``. Addresses are free loopback ports.
One variable Vertex does not set marks the simulation: ``VERTEXRT_LOCAL_RUN=1``. Each job (and trial) reports
hypertune metrics to its own ``CLOUD_ML_HP_METRIC_FILE`` under its local output directory, unless the shell
sets one. A managed-dataset job is simulated with ``--training-data``, ``--validation-data``, ``--test-data``
and ``--data-format`` (or those ``AIP_*`` variables set in the shell, passed through). Output lines are
prefixed by the Vertex replica name (``workerpool0-0``, ``workerpool1-0``; ``/<local rank>`` with several
processes per replica); after a teardown each replica's exit code is printed. The job succeeds when the chief
exits 0, as Vertex judges a job; when the chief fails, or a worker does (Vertex would restart it; here the job
fails with the worker's exit code), every replica is torn down (SIGTERM, ``--grace`` seconds, SIGKILL) with
every process it started, daemons included; a watchdog does the same if the launcher itself is killed (see
:mod:`vertexrt.distributed.reaper`). Output is relayed as it arrives, partial lines (progress bars) too.

``--workers N`` counts training replicas including the chief (workerpool0 + N-1 in workerpool1), like the
SDK's ``replica_count``. ``--processes-per-node K`` starts K processes per training replica with the variables
torchrun would set. ``--reduction-server`` lists workerpool2 replicas but runs nothing there (the real one is
Google's image); TF_CONFIG does not list them. Parameter servers and evaluators do not get ``RANK`` (their
value on Vertex is unverified).

Fault injection: ``--stagger S`` starts the replicas S seconds apart, the chief replica last, as VMs come up
on Vertex (the workers must wait for the chief's address); ``--preempt-after S`` preempts the first attempt S
seconds after it starts (SIGTERM to every replica, grace, SIGKILL) and restarts the whole job; ``--restarts
N`` bounds restarts after a preemption or a failure (default 1 with ``--preempt-after``, else 0).

Example:
    $ vertexrt local-run --workers 2 -- python train.py --lr=0.1
    $ vertexrt local-run --workers 2 --processes-per-node 2 --preempt-after 20 -- python train.py
    $ vertexrt local-run --workers 2 --stagger 5 --training-data gs://b/train.jsonl -- python train.py
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import math
import os
import re
import selectors
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO, Protocol

from vertexrt import env as contract
from vertexrt._net import free_ports
from vertexrt.distributed import reaper
from vertexrt.distributed.detection import cluster
from vertexrt.distributed.torch import child_environment
from vertexrt.errors import ConfigError

#: A replica inherits no platform variable (:func:`vertexrt.env.is_platform_variable`) from the launching
#: shell: the launcher sets them. The managed-dataset ones come from ``--training-data``... or, when the user
#: set them in the shell, from there, said on a line of its own.
DATA_VARIABLES = {
    "training_data": "AIP_TRAINING_DATA_URI",
    "validation_data": "AIP_VALIDATION_DATA_URI",
    "test_data": "AIP_TEST_DATA_URI",
    "data_format": "AIP_DATA_FORMAT",
}


#: Vertex pool -> its TF_CONFIG task type.
_TF_TYPES = {"workerpool0": "chief", "workerpool1": "worker", "workerpool2": "ps", "workerpool3": "evaluator"}
_SETTLE_SECONDS = 5.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add ``local-run``'s options to ``parser``."""
    parser.add_argument("--workers", type=_positive, default=1, help="training replicas, chief included")
    parser.add_argument("--ps", type=_non_negative, default=0, help="parameter servers (workerpool2)")
    parser.add_argument(
        "--reduction-server",
        type=_positive,
        nargs="?",
        const=1,
        default=0,
        metavar="N",
        help="list N Reduction Server replicas in workerpool2 (none runs locally)",
    )
    parser.add_argument("--evaluator", action="store_true", help="one evaluator replica (workerpool3)")
    parser.add_argument(
        "--processes-per-node",
        type=_positive,
        default=1,
        metavar="K",
        help="processes per training replica, with torchrun's variables",
    )
    parser.add_argument("--trial", default=None, help="hyperparameter-tuning trial ID (CLOUD_ML_TRIAL_ID)")
    parser.add_argument(
        "--base-output-dir",
        default=None,
        help="AIP_* directories go under it (default ./vertexrt_output/<job id>)",
    )
    parser.add_argument(
        "--job-id", default=None, help="CLOUD_ML_JOB_ID (default: a numeric ID from the clock)"
    )
    parser.add_argument(
        "--project", default=None, help="CLOUD_ML_PROJECT_ID (default: $GOOGLE_CLOUD_PROJECT)"
    )
    parser.add_argument("--region", default="us-central1", help="CLOUD_ML_REGION")
    parser.add_argument(
        "--preempt-after",
        type=_seconds,
        default=None,
        metavar="SECONDS",
        help="preempt the first attempt after SECONDS, then restart the whole job",
    )
    parser.add_argument(
        "--restarts",
        type=_non_negative,
        default=None,
        help="whole-job restarts allowed after a preemption or failure",
    )
    parser.add_argument(
        "--grace",
        type=_seconds,
        default=15.0,
        metavar="SECONDS",
        help="seconds between SIGTERM and SIGKILL (Vertex/GKE: about 15)",
    )
    parser.add_argument(
        "--stagger",
        type=_seconds,
        default=0.0,
        metavar="SECONDS",
        help="start the replicas SECONDS apart, the chief last (VMs come up minutes apart on Vertex)",
    )
    chaos = parser.add_argument_group("fault certificate (see vertexrt.distributed.chaos.driver)")
    chaos.add_argument(
        "--chaos",
        type=_positive,
        default=None,
        metavar="N",
        help="run once without faults, then N times under seeded faults, and compare with the first",
    )
    chaos.add_argument("--seed", type=int, default=0, help="the fault schedule's seed (with --chaos)")
    chaos.add_argument("--chaos-report", metavar="FILE", help="write the certificate as JSON to FILE")
    chaos.add_argument(
        "--chaos-rtol",
        type=_seconds,
        default=None,
        metavar="X",
        help="relative tolerance for numbers in model files that differ and parse (JSON, NumPy, torch)",
    )
    data = parser.add_argument_group("managed dataset (what Vertex sets for a managed-dataset job)")
    data.add_argument("--training-data", metavar="URI", help="AIP_TRAINING_DATA_URI")
    data.add_argument("--validation-data", metavar="URI", help="AIP_VALIDATION_DATA_URI")
    data.add_argument("--test-data", metavar="URI", help="AIP_TEST_DATA_URI")
    data.add_argument(
        "--data-format", metavar="FORMAT", help="AIP_DATA_FORMAT (jsonl, csv, tf-record, bigquery...)"
    )
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- the training command")


def run(args: argparse.Namespace) -> int:
    """Run the job described by ``args`` (from :func:`add_arguments`); returns the job's exit code."""
    command = list(args.command)
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        raise ConfigError(
            "local-run: no command given; usage: vertexrt local-run --workers 2 -- python train.py"
        )
    command = with_this_python(command)
    if args.ps and args.reduction_server:
        raise ConfigError("local-run: --ps and --reduction-server both use workerpool2; choose one")
    if not 0 <= args.stagger <= 3600:
        raise ConfigError(f"local-run: --stagger {args.stagger:g}: give seconds between 0 and 3600")
    job = JobSpec(
        command=command,
        workers=args.workers,
        ps=args.ps,
        reduction_servers=args.reduction_server,
        evaluators=1 if args.evaluator else 0,
        processes_per_node=args.processes_per_node,
        trial=args.trial,
        job_id=args.job_id or str(int(time.time() * 1000)),
        project=args.project
        or os.environ.get("GOOGLE_CLOUD_PROJECT")
        or os.environ.get("CLOUDSDK_CORE_PROJECT")
        or "local-project",
        region=args.region,
        base_output_dir=args.base_output_dir,
        data=_data_variables(args, os.environ),
        stagger=args.stagger,
    )
    if args.chaos is not None:
        if args.preempt_after is not None or args.trial:
            raise ConfigError(
                "local-run: --chaos places its own faults; leave out --preempt-after and --trial"
            )
        from vertexrt.distributed.chaos.driver import Options, certify

        options = Options(args.chaos, args.seed, args.grace, args.chaos_rtol, args.chaos_report)
        return certify(job, options)
    restarts = args.restarts if args.restarts is not None else (1 if args.preempt_after is not None else 0)
    return Supervisor(job, grace=args.grace, preempt_after=args.preempt_after, restarts=restarts).run()


def with_this_python(command: Sequence[str]) -> list[str]:
    """``command`` with a bare ``python``/``python3`` replaced by this interpreter (``sys.executable``), so
    the replicas run in the environment ``vertexrt`` was started from, not whatever is first on ``PATH``."""
    if command and command[0] in ("python", "python3"):
        return [sys.executable, *command[1:]]
    return list(command)


@dataclass(frozen=True)
class JobSpec:
    """What to run and the shape of the simulated Vertex job."""

    command: list[str]
    workers: int = 1
    ps: int = 0
    reduction_servers: int = 0
    evaluators: int = 0
    processes_per_node: int = 1
    trial: str | None = None
    job_id: str = "local"
    project: str = "local-project"
    region: str = "us-central1"
    base_output_dir: str | None = None
    data: Mapping[str, str] = field(default_factory=dict)  # AIP_*_DATA_URI, AIP_DATA_FORMAT
    stagger: float = 0.0


def _data_variables(args: argparse.Namespace, environ: Mapping[str, str]) -> dict[str, str]:
    """The managed-dataset variables: each flag given, else the variable the user set in the environment
    (said on a line of its own, as a replica would otherwise seem to invent it)."""
    data = {}
    for option, name in DATA_VARIABLES.items():
        value = getattr(args, option, None)
        if value is not None:
            if not value.strip():
                flag = "--" + option.replace("_", "-")
                raise ConfigError(f"local-run: {flag} is empty: give a value or leave it out")
            data[name] = value
        elif environ.get(name):
            data[name] = environ[name]
            _say(f"passing {name}={environ[name]} from your environment to every replica")
    return data


@dataclass(frozen=True)
class Replica:
    """One process to start: its label (the Vertex replica name, ``workerpool1-0``, and ``/<local rank>``
    with several processes per replica), pool, and full environment."""

    label: str
    pool: str
    index: int
    env: dict[str, str]
    runs: bool = True

    @property
    def on_chief_replica(self) -> bool:
        """On workerpool0-0, the replica that judges the job (with several processes per replica, every
        one of them is here; the chief *process* is only rank 0)."""
        return self.pool == "workerpool0"


def replica_environments(job: JobSpec, base_env: Mapping[str, str], ports: Sequence[int]) -> list[Replica]:
    """Every process of ``job`` with the environment Vertex would give it; ``ports`` supplies one free port
    per replica plus one for ``MASTER_PORT``."""
    sizes = {
        "workerpool0": 1,
        "workerpool1": job.workers - 1,
        "workerpool2": job.ps or job.reduction_servers,
        "workerpool3": job.evaluators,
    }
    free = iter(ports)
    pools = {name: [f"127.0.0.1:{next(free)}" for _ in range(n)] for name, n in sizes.items() if n}
    master_port = next(free)
    multi = sum(sizes.values()) > 1
    tf_cluster = {
        _TF_TYPES[n]: a
        for n, a in pools.items()
        if n != "workerpool3" and not (n == "workerpool2" and job.reduction_servers)
    }
    common = {k: v for k, v in base_env.items() if not contract.is_platform_variable(k)}
    common.update(_job_variables(job))
    common.update(job.data)
    if "CLOUD_ML_HP_METRIC_FILE" not in base_env:  # each job and trial its own, not one shared default
        common["CLOUD_ML_HP_METRIC_FILE"] = _metric_file(job)
    common.setdefault("PYTHONUNBUFFERED", "1")
    common["VERTEXRT_LOCAL_RUN"] = "1"
    job_field = {"python_module": "", "package_uris": [], "job_args": job.command[1:]}
    replicas = []
    for pool, addresses in pools.items():
        for index in range(len(addresses)):
            env = dict(common)
            task = {"type": pool, "index": index, "trial": job.trial or ""}
            env["CLUSTER_SPEC"] = json.dumps(
                {"cluster": pools, "environment": "cloud", "task": task, "job": job_field}
            )
            node_rank = {"workerpool0": 0, "workerpool1": 1 + index}.get(pool)
            if multi:
                tf_task = {
                    "type": _TF_TYPES[pool],
                    "index": index,
                    **({"trial": job.trial} if job.trial else {}),
                }
                env["TF_CONFIG"] = json.dumps(
                    {"cluster": tf_cluster, "environment": "cloud", "task": tf_task, "job": job_field}
                )
                env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(master_port), WORLD_SIZE=str(job.workers))
                if node_rank is not None:
                    env["RANK"] = str(node_rank)
            label = f"{pool}-{index}"
            if pool == "workerpool2" and job.reduction_servers:
                replicas.append(Replica(label=label, pool=pool, index=index, env=env, runs=False))
            elif node_rank is not None and job.processes_per_node > 1:
                node = cluster(env)
                for local in range(job.processes_per_node):
                    local_env = dict(env)
                    local_env.update(
                        child_environment(node, local, job.processes_per_node, f"127.0.0.1:{master_port}")
                    )
                    replicas.append(Replica(label=f"{label}/{local}", pool=pool, index=index, env=local_env))
            else:
                replicas.append(Replica(label=label, pool=pool, index=index, env=env))
    return replicas


def port_count(job: JobSpec) -> int:
    """Ports :func:`replica_environments` needs: one per replica and ``MASTER_PORT``."""
    return job.workers + max(job.ps, job.reduction_servers) + job.evaluators + 1


def _base_dir(job: JobSpec, local: bool = False) -> str:
    """The job's (trial-scoped) output directory, ``/``-terminated; ``local``: on this machine even when
    ``--base-output-dir`` is a ``gs://`` URI."""
    base = job.base_output_dir or os.path.join("vertexrt_output", job.job_id)
    if local and "://" in base:
        base = os.path.join("vertexrt_output", job.job_id)
    if "://" not in base:
        base = str(Path(base).absolute())
    return base.rstrip("/") + "/" + (f"{job.trial}/" if job.trial else "")


def _metric_file(job: JobSpec) -> str:
    """Where this job's (trial's) hypertune reports go: under its local output directory."""
    return _base_dir(job, local=True) + "hypertune/output.metrics"


def _job_variables(job: JobSpec) -> dict[str, str]:
    base = _base_dir(job)
    variables = {
        "CLOUD_ML_JOB_ID": job.job_id,
        "CLOUD_ML_PROJECT_ID": job.project,
        "CLOUD_ML_REGION": job.region,
        "AIP_MODEL_DIR": base + "model/",
        "AIP_CHECKPOINT_DIR": base + "checkpoints/",
        "AIP_TENSORBOARD_LOG_DIR": base + "logs/",
    }
    if job.trial:
        variables["CLOUD_ML_TRIAL_ID"] = job.trial
    return variables


@dataclass
class _Running:
    replica: Replica
    proc: subprocess.Popen[bytes]
    returncode: int | None = None
    reported: bool = False


_LINE_END = re.compile(rb"(\r\n|\r|\n)(?=[\s\S])")  # a line end with more output after it
_HOLD_BYTES = 1 << 16  # an unfinished line is held back at most this long...
_HOLD_SECONDS = 0.05  # ... or this long, for its newline (print() writes text and "\n" separately)


@dataclass
class _Stream:
    r"""One replica's output: its unfinished line, whether its next byte starts a line, whether it ended
    on ``\r``."""

    prefix: bytes
    pending: bytearray = field(default_factory=bytearray)
    since: float = 0.0
    at_line_start: bool = True
    after_cr: bool = False


class OutputRelay:
    r"""Relays replicas' output to ``out`` as it arrives, every line prefixed with the replica's label.

    ``\r`` ends a line as ``\n`` does, so each redraw of a progress bar keeps its prefix. An unfinished line
    waits for its end at most 64 KiB or 50 ms (call :meth:`flush`), then is written as it is; when another
    replica writes while such a line is open on ``out``, that line is closed first. Work is linear in the
    output and memory bounded by 64 KiB per replica.

    Example:
        >>> import io
        >>> out = io.BytesIO()
        >>> relay = OutputRelay(out)
        >>> relay.feed("workerpool0-0", b"10%\r20%")
        >>> relay.flush(older_than=0)
        >>> relay.feed("workerpool1-0", b"ready\n")
        >>> out.getvalue()
        b'[workerpool0-0] 10%\r[workerpool0-0] 20%\n[workerpool1-0] ready\n'
    """

    def __init__(self, out: BinaryIO) -> None:
        self.out = out
        self._streams: dict[str, _Stream] = {}
        self._open: _Stream | None = None  # the stream whose line is unfinished on `out`
        self._last: _Stream | None = None  # the stream written last

    def feed(self, label: str, chunk: bytes) -> None:
        """Relay ``chunk`` of ``label``'s output: its finished lines now, an unfinished one held back."""
        stream = self._streams.setdefault(label, _Stream(f"[{label}] ".encode()))
        if stream.after_cr and not stream.pending and chunk[:1] == b"\n":  # \r\n split between two reads
            chunk = chunk[1:]
            if self._last is stream:
                self._write(b"\n")
        end = max(chunk.rfind(b"\n"), chunk.rfind(b"\r")) + 1
        if end:
            self._emit(stream, bytes(stream.pending) + chunk[:end])
            stream.pending.clear()
        if end < len(chunk):
            if not stream.pending:
                stream.since = time.monotonic()
            stream.pending += chunk[end:]
            if len(stream.pending) >= _HOLD_BYTES:
                self._emit_pending(stream)

    def flush(self, older_than: float = _HOLD_SECONDS) -> None:
        """Write every unfinished line held back for ``older_than`` seconds or more."""
        now = time.monotonic()
        for stream in self._streams.values():
            if stream.pending and now - stream.since >= older_than:
                self._emit_pending(stream)

    def interrupt(self) -> None:
        """Close the line open on ``out``, so that something else can be written there."""
        if self._open is not None:
            self._write(b"\n")
            self._open.at_line_start = True
            self._open = None

    def close(self, label: str) -> None:
        """``label``'s output ended: write what is held back and finish its line."""
        stream = self._streams.pop(label, None)
        if stream is None:
            return
        self._emit_pending(stream)
        if self._open is stream:
            self.interrupt()

    def _emit_pending(self, stream: _Stream) -> None:
        if stream.pending:
            self._emit(stream, bytes(stream.pending))
            stream.pending.clear()

    def _emit(self, stream: _Stream, data: bytes) -> None:
        if self._open is not stream:
            self.interrupt()
        head = stream.prefix if stream.at_line_start else b""
        self._write(head + _LINE_END.sub(lambda m: m.group(1) + stream.prefix, data))
        stream.at_line_start = data.endswith((b"\n", b"\r"))
        stream.after_cr = data.endswith(b"\r")
        self._open = None if stream.at_line_start else stream
        self._last = stream

    def _write(self, data: bytes) -> None:
        self.out.write(data)
        self.out.flush()


@dataclass(frozen=True)
class FaultNotice:
    """A fault that landed in a replica (it signalled itself, see :mod:`vertexrt.audit`): ``everyone``
    means Vertex preempts every replica (the others get SIGTERM now); the attempt ends ``grace`` seconds
    later at most."""

    replica: str
    everyone: bool
    grace: float


class FaultSource(Protocol):
    """The chaos driver's side of an attempt: extra variables per replica, and the fault once it landed."""

    def environment(self, attempt: int, replica: Replica) -> dict[str, str]: ...

    def notice(self, attempt: int) -> FaultNotice | None: ...


@dataclass(frozen=True)
class Attempt:
    """How one attempt of the job ended: ``outcome`` (succeeded, failed, preempted, interrupted), the job's
    exit code and each replica's."""

    outcome: str
    code: int
    codes: dict[str, int]


@dataclass
class Supervisor:
    """Starts the replicas, relays their output, judges the job by the chief, tears down, restarts."""

    job: JobSpec
    grace: float = 15.0
    preempt_after: float | None = None
    restarts: int = 0
    out: BinaryIO = field(default_factory=lambda: sys.stdout.buffer)
    faults: FaultSource | None = None
    attempts: list[Attempt] = field(default_factory=list, init=False)
    _running: list[_Running] = field(default_factory=list, init=False)
    _selector: selectors.BaseSelector = field(default_factory=selectors.DefaultSelector, init=False)
    _stop_signal: int | None = field(default=None, init=False)
    _run_id: str = field(default_factory=lambda: uuid.uuid4().hex, init=False)
    _sessions: set[int] = field(default_factory=set, init=False)
    _relay: OutputRelay = field(init=False)
    _watchdog: subprocess.Popen[bytes] | None = field(default=None, init=False)
    _codes: dict[str, int] = field(default_factory=dict, init=False)

    def __post_init__(self) -> None:
        self._relay = OutputRelay(self.out)

    def run(self) -> int:
        main_thread = threading.current_thread() is threading.main_thread()
        handled = (signal.SIGINT, signal.SIGTERM) if main_thread else ()
        previous = {s: signal.signal(s, self._on_signal) for s in handled}
        self._watchdog = watchdog = _start_watchdog(self._run_id)
        try:
            attempt = 0
            while True:
                attempt += 1
                outcome, code = self._attempt(attempt, preempt=self.preempt_after if attempt == 1 else None)
                if outcome in ("preempted", "failed") and attempt <= self.restarts:
                    self._say(f"{outcome}: restarting the whole job (restart {attempt} of {self.restarts})")
                    continue
                self._say(f"job {outcome} with exit code {code}")
                return code
        finally:
            _stop_watchdog(watchdog)
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            self._selector.close()

    def _say(self, message: str) -> None:
        self._relay.interrupt()  # our message on a line of its own, not after a replica's unfinished one
        _say(message)

    def _on_signal(self, signum: int, _frame: object) -> None:
        self._stop_signal = signum

    def _attempt(self, attempt: int, preempt: float | None) -> tuple[str, int]:
        replicas = replica_environments(self.job, os.environ, free_ports(port_count(self.job)))
        if self.faults is not None:
            for replica in replicas:
                replica.env.update(self.faults.environment(attempt, replica))
        codes: dict[str, int] = {}
        try:
            for replica in replicas:
                if not replica.runs:
                    self._say(f"{replica.label}: listed in CLUSTER_SPEC, not run locally")
            if self.job.stagger:  # VMs come up apart; the chief (and its listening port) last
                replicas.sort(key=lambda r: r.on_chief_replica)
            for i, replica in enumerate(r for r in replicas if r.runs):
                if i and self.job.stagger:
                    self._wait(lambda r: False, timeout=self.job.stagger, until=self._stopping)
                if self._stopping():  # a signal or a failure: start no more replicas, _watch reports it
                    break
                self._start(replica)
            outcome, code = self._watch(attempt, time.monotonic(), preempt)
            if outcome == "succeeded":  # Vertex then shuts the others down; let workers finish first
                self._wait(
                    lambda r: r.replica.pool != "workerpool1", timeout=min(self.grace, _SETTLE_SECONDS)
                )
        finally:
            codes = {**self._codes, **self._teardown()}
            self._codes = {}
        self.attempts.append(Attempt(outcome, code, codes))
        return outcome, code

    def _start(self, replica: Replica) -> None:
        try:
            proc = subprocess.Popen(
                self.job.command,
                env={**replica.env, reaper.RUN_ID_VARIABLE: self._run_id},
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=_die_with_parent,
            )
        except OSError as err:
            raise ConfigError(
                f"local-run: cannot start {self.job.command[0]!r} for {replica.label}: {err}"
            ) from None
        self._sessions.add(proc.pid)  # start_new_session: the replica leads its own session
        self._tell_watchdog(f"session {proc.pid}\n")
        running = _Running(replica, proc)
        os.set_blocking(proc.stdout.fileno(), False)  # type: ignore[union-attr]
        self._selector.register(proc.stdout, selectors.EVENT_READ, running)  # type: ignore[arg-type]
        self._running.append(running)

    def _watch(self, attempt: int, started: float, preempt: float | None) -> tuple[str, int]:
        while True:
            self._pump(0.1)
            notice = self.faults.notice(attempt) if self.faults is not None else None
            if notice is not None:
                return self._fault(notice)
            for r in self._running:
                if r.returncode is None or r.reported:
                    continue
                r.reported = True
                self._say(f"{r.replica.label} exited with code {r.returncode}")
                if r.returncode != 0 and r.replica.pool in ("workerpool0", "workerpool1"):
                    who = "the chief replica" if r.replica.on_chief_replica else "replica"
                    self._say(f"{who} {r.replica.label} failed: tearing down every replica")
                    return "failed", r.returncode
            chief = [r for r in self._running if r.replica.on_chief_replica]
            if chief and all(r.returncode == 0 for r in chief):  # none when stopped before it started
                return "succeeded", 0
            if self._stop_signal is not None:
                self._say(f"received signal {self._stop_signal}: tearing down every replica")
                return "interrupted", 128 + self._stop_signal
            if preempt is not None and time.monotonic() - started >= preempt:
                self._say(
                    f"preempting the job after {preempt:g}s: SIGTERM to every replica, {self.grace:g}s grace"
                )
                return self._preempted(self._keep(self._teardown()))

    def _fault(self, notice: FaultNotice) -> tuple[str, int]:
        """A fault landed in ``notice.replica``: SIGTERM the others when every replica is preempted, let
        the replicas exit by themselves for the grace, then end the attempt as Vertex would."""
        if notice.everyone:
            for r in self._running:
                if r.returncode is None and r.replica.label != notice.replica:
                    with contextlib.suppress(ProcessLookupError):
                        r.proc.send_signal(signal.SIGTERM)
        self._say(
            f"fault in {notice.replica}: "
            + ("SIGTERM to every replica" if notice.everyone else "that replica only")
            + f", {notice.grace:g}s grace"
        )
        self._wait(lambda r: False, timeout=notice.grace)
        return self._preempted(self._keep(self._teardown(grace=0, waited=notice.grace)))

    def _keep(self, codes: dict[str, int]) -> dict[str, int]:
        """Remember ``codes`` (a teardown's) for this attempt's record."""
        self._codes.update(codes)
        return codes

    def _preempted(self, codes: Mapping[str, int]) -> tuple[str, int]:
        """The outcome of a preempted attempt whose replicas exited with ``codes``: a job whose training
        replicas all exited 0 finished (Vertex judges by exit codes and does not run it again)."""
        trained = {
            label: code
            for label, code in codes.items()
            if not label.startswith(("workerpool2", "workerpool3"))
        }
        if trained and all(code == 0 for code in trained.values()):
            self._say("every replica exited 0 after the notice: the job finished, no restart")
            return "succeeded", 0
        chief = [code for label, code in codes.items() if label.startswith("workerpool0")]
        return "preempted", next((c for c in chief if c), 0)

    def _pump(self, timeout: float) -> None:
        for key, _ in self._selector.select(timeout):
            running: _Running = key.data
            try:
                chunk = os.read(key.fd, 1 << 16)
            except BlockingIOError:
                continue
            if not chunk:
                self._selector.unregister(key.fileobj)
                self._relay.close(running.replica.label)
                continue
            self._relay.feed(running.replica.label, chunk)
        self._relay.flush()
        for r in self._running:
            if r.returncode is None and r.proc.poll() is not None:
                r.returncode = _exit_code(r.proc.returncode)

    def _wait(
        self, done: Callable[[_Running], bool], timeout: float, until: Callable[[], bool] = lambda: False
    ) -> None:
        """Relay output until every running replica is ``done`` or has exited, ``until()`` holds, or
        ``timeout`` seconds pass."""
        deadline = time.monotonic() + timeout
        while (
            time.monotonic() < deadline
            and not until()
            and any(r.returncode is None and not done(r) for r in self._running)
        ):
            self._pump(0.05)

    def _stopping(self) -> bool:
        """A signal arrived, or a training replica failed: the job ends."""
        return self._stop_signal is not None or any(
            r.returncode not in (None, 0) and r.replica.pool in ("workerpool0", "workerpool1")
            for r in self._running
        )

    def _teardown(self, grace: float | None = None, waited: float | None = None) -> dict[str, int]:
        """SIGTERM each replica's main process, as a container runtime signals PID 1 only (its DataLoader
        workers and other children must outlive the notice), wait ``grace`` for the replicas, SIGKILL
        everything left (the replica's process group, daemons that left it too); relay their output."""
        grace = self.grace if grace is None else grace
        waited = grace if waited is None else waited  # the grace the replicas had, for the message
        alive = [r for r in self._running if r.returncode is None]
        for r in alive:
            with contextlib.suppress(ProcessLookupError):
                r.proc.send_signal(signal.SIGTERM)
        self._wait(lambda r: False, timeout=grace if alive else 0)
        killed = [r for r in self._running if r.returncode is None]
        for r in self._running:
            _signal_group(r.proc.pid, signal.SIGKILL)  # also reaps grandchildren left in the group
        reaper.kill_all(self._run_id, self._sessions)
        for r in self._running:
            r.proc.wait()
            r.returncode = _exit_code(r.proc.returncode)
            if r in killed:
                self._say(f"{r.replica.label} ignored SIGTERM: SIGKILLed after the {waited:g} s grace")
            elif not r.reported:
                self._say(f"{r.replica.label} exited with code {r.returncode}")
            r.reported = True
        codes = {r.replica.label: r.returncode for r in self._running if r.returncode is not None}
        deadline = time.monotonic() + 2.0  # a daemonised grandchild may hold a pipe open: stop relaying
        while self._selector.get_map() and time.monotonic() < deadline:
            self._pump(0.05)
        for key in list(self._selector.get_map().values()):
            self._selector.unregister(key.fileobj)
            self._relay.close(key.data.replica.label)
        for r in self._running:
            r.proc.stdout.close()  # type: ignore[union-attr]
        self._running.clear()
        self._tell_watchdog("".join(f"end {pid}\n" for pid in self._sessions))
        self._sessions.clear()
        return codes

    def _tell_watchdog(self, lines: str) -> None:
        if self._watchdog is not None and self._watchdog.stdin is not None:
            with contextlib.suppress(OSError):
                self._watchdog.stdin.write(lines.encode())
                self._watchdog.stdin.flush()


def _signal_group(pid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, sig)


_LIBC = ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None
_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    """In the child: SIGKILL me if the launcher dies, so no replica outlives it."""
    if _LIBC is not None:
        _LIBC.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def _exit_code(returncode: int) -> int:
    return 128 - returncode if returncode < 0 else returncode


def _start_watchdog(run_id: str) -> subprocess.Popen[bytes]:
    """The reaper that outlives the launcher: it kills the job's processes when our pipe to it closes."""
    return subprocess.Popen(
        [sys.executable, "-m", "vertexrt.distributed.reaper", run_id],
        stdin=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        start_new_session=True,  # not in the terminal's process group: a Ctrl-C goes to the launcher
    )


def _stop_watchdog(watchdog: subprocess.Popen[bytes]) -> None:
    with contextlib.suppress(OSError):
        watchdog.stdin.close()  # type: ignore[union-attr]
    try:
        watchdog.wait(30)
    except subprocess.TimeoutExpired:
        watchdog.kill()
        watchdog.wait()


def _say(message: str) -> None:
    print(f"[local-run] {message}", file=sys.stderr, flush=True)


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text}")
    return value


def _seconds(text: str) -> float:
    value = float(text)
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"expected a finite number of seconds >= 0, got {text!r}")
    return value


def _non_negative(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected a non-negative integer, got {text}")
    return value


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m vertexrt.distributed.launcher ...`` (the same as ``vertexrt local-run ...``)."""
    parser = argparse.ArgumentParser(prog="vertexrt local-run", description=__doc__.splitlines()[0])
    add_arguments(parser)
    try:
        return run(parser.parse_args(argv))
    except ConfigError as err:
        print(f"vertexrt local-run: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

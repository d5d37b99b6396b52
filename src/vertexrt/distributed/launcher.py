"""``vertexrt local-run``: run a training command as an N-replica Vertex job on this machine.

Each replica gets the environment Vertex would give it: ``CLUSTER_SPEC`` (always), and on multi-replica jobs
``TF_CONFIG``, ``MASTER_ADDR``/``MASTER_PORT`` and node-level ``WORLD_SIZE``/``RANK``; ``AIP_MODEL_DIR``,
``AIP_CHECKPOINT_DIR``, ``AIP_TENSORBOARD_LOG_DIR`` under ``--base-output-dir`` (trial-scoped with
``--trial``); ``CLOUD_ML_JOB_ID``/``PROJECT_ID``/``REGION``/``TRIAL_ID``. Addresses are free loopback
ports. One variable Vertex does not set marks the simulation: ``VERTEXRT_LOCAL_RUN=1``.
Output lines are prefixed by replica. The job succeeds when the chief exits 0, as Vertex judges a job; when
the chief fails, or a worker does (Vertex would restart it; here the job fails with the worker's exit
code), every replica is torn down (SIGTERM, ``--grace`` seconds, SIGKILL).

``--workers N`` counts training replicas including the chief (workerpool0 + N-1 in workerpool1), like the
SDK's ``replica_count``. ``--processes-per-node K`` starts K processes per training replica with the
variables torchrun would set. ``--reduction-server`` lists workerpool2 replicas but runs nothing there (the
real one is Google's image); TF_CONFIG does not list them. Parameter servers and evaluators do not get
``RANK`` (their value on Vertex is unverified).

Fault injection: ``--preempt-after S`` preempts the first attempt S seconds after it starts (SIGTERM to every
replica, grace, SIGKILL) and restarts the whole job; ``--restarts N`` bounds restarts after a preemption or a
failure (default 1 with ``--preempt-after``, else 0).

Example:
    $ vertexrt local-run --workers 2 -- python train.py --lr=0.1
    $ vertexrt local-run --workers 2 --processes-per-node 2 --preempt-after 20 -- python train.py
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import os
import selectors
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

from vertexrt.distributed.detection import cluster
from vertexrt.distributed.torch import child_environment
from vertexrt.errors import ConfigError

#: Variables a replica must not inherit from the launching shell: the launcher sets its own.
SCRUBBED_PREFIXES = ("AIP_", "CLOUD_ML_", "TORCHELASTIC_", "ROLE_")
#: ... except these, which the user sets to capture a trial's hypertune reports where they want.
KEPT = frozenset({"CLOUD_ML_HP_METRIC_FILE", "CLOUD_ML_HP_METRIC_TAG"})
SCRUBBED = frozenset(
    {
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
        "VERTEXRT_WORKERPOOL2",
    }
)
#: Vertex pool -> its TF_CONFIG task type, which also labels the replica's log lines.
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
        type=float,
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
        type=float,
        default=15.0,
        metavar="SECONDS",
        help="seconds between SIGTERM and SIGKILL (Vertex/GKE: about 15)",
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
    if args.ps and args.reduction_server:
        raise ConfigError("local-run: --ps and --reduction-server both use workerpool2; choose one")
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
    )
    restarts = args.restarts if args.restarts is not None else (1 if args.preempt_after is not None else 0)
    return Supervisor(job, grace=args.grace, preempt_after=args.preempt_after, restarts=restarts).run()


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


@dataclass(frozen=True)
class Replica:
    """One process to start: its label (log prefix), pool, and full environment."""

    label: str
    pool: str
    index: int
    env: dict[str, str]
    runs: bool = True

    @property
    def is_chief(self) -> bool:
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
    common = {
        k: v
        for k, v in base_env.items()
        if k in KEPT or (k not in SCRUBBED and not k.startswith(SCRUBBED_PREFIXES))
    }
    common.update(_job_variables(job))
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
            label = _TF_TYPES[pool] + ("" if pool == "workerpool0" else f"-{index}")
            if pool == "workerpool2" and job.reduction_servers:
                replicas.append(
                    Replica(label=f"reduction-server-{index}", pool=pool, index=index, env=env, runs=False)
                )
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


def _job_variables(job: JobSpec) -> dict[str, str]:
    base = job.base_output_dir or os.path.join("vertexrt_output", job.job_id)
    if "://" not in base:
        base = str(Path(base).absolute())
    base = base.rstrip("/") + "/" + (f"{job.trial}/" if job.trial else "")
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
    buffer: bytes = b""
    returncode: int | None = None
    reported: bool = False


@dataclass
class Supervisor:
    """Starts the replicas, relays their output, judges the job by the chief, tears down, restarts."""

    job: JobSpec
    grace: float = 15.0
    preempt_after: float | None = None
    restarts: int = 0
    out: BinaryIO = field(default_factory=lambda: sys.stdout.buffer)
    _running: list[_Running] = field(default_factory=list, init=False)
    _selector: selectors.BaseSelector = field(default_factory=selectors.DefaultSelector, init=False)
    _stop_signal: int | None = field(default=None, init=False)

    def run(self) -> int:
        main_thread = threading.current_thread() is threading.main_thread()
        handled = (signal.SIGINT, signal.SIGTERM) if main_thread else ()
        previous = {s: signal.signal(s, self._on_signal) for s in handled}
        try:
            attempt = 0
            while True:
                attempt += 1
                outcome, code = self._attempt(preempt=self.preempt_after if attempt == 1 else None)
                if outcome in ("preempted", "failed") and attempt <= self.restarts:
                    _say(f"{outcome}: restarting the whole job (restart {attempt} of {self.restarts})")
                    continue
                _say(f"job {outcome} with exit code {code}")
                return code
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            self._selector.close()

    def _on_signal(self, signum: int, _frame: object) -> None:
        self._stop_signal = signum

    def _attempt(self, preempt: float | None) -> tuple[str, int]:
        replicas = replica_environments(self.job, os.environ, _free_ports(port_count(self.job)))
        try:
            for replica in replicas:
                if replica.runs:
                    self._start(replica)
                else:
                    _say(f"{replica.label}: listed in CLUSTER_SPEC, not run locally")
            outcome, code = self._watch(time.monotonic(), preempt)
            if outcome == "succeeded":  # Vertex then shuts the others down; let workers finish first
                self._wait(
                    lambda r: r.replica.pool != "workerpool1", timeout=min(self.grace, _SETTLE_SECONDS)
                )
        finally:
            self._teardown()
        return outcome, code

    def _start(self, replica: Replica) -> None:
        try:
            proc = subprocess.Popen(
                self.job.command,
                env=replica.env,
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
        running = _Running(replica, proc)
        os.set_blocking(proc.stdout.fileno(), False)  # type: ignore[union-attr]
        self._selector.register(proc.stdout, selectors.EVENT_READ, running)  # type: ignore[arg-type]
        self._running.append(running)

    def _watch(self, started: float, preempt: float | None) -> tuple[str, int]:
        while True:
            self._pump(0.1)
            for r in self._running:
                if r.returncode is None or r.reported:
                    continue
                r.reported = True
                _say(f"{r.replica.label} exited with code {r.returncode}")
                if r.returncode != 0 and r.replica.pool in ("workerpool0", "workerpool1"):
                    who = "the chief" if r.replica.is_chief else r.replica.label
                    _say(f"{who} failed: tearing down every replica")
                    return "failed", r.returncode
            chief = [r for r in self._running if r.replica.is_chief]
            if all(r.returncode == 0 for r in chief):
                return "succeeded", 0
            if self._stop_signal is not None:
                _say(f"received signal {self._stop_signal}: tearing down every replica")
                return "interrupted", 128 + self._stop_signal
            if preempt is not None and time.monotonic() - started >= preempt:
                _say(
                    f"preempting the job after {preempt:g}s: SIGTERM to every replica, {self.grace:g}s grace"
                )
                self._teardown()
                chief_code = next((r.returncode for r in chief if r.returncode), 0) or 0
                return "preempted", chief_code

    def _pump(self, timeout: float) -> None:
        for key, _ in self._selector.select(timeout):
            running: _Running = key.data
            try:
                chunk = os.read(key.fd, 1 << 16)
            except BlockingIOError:
                continue
            if not chunk:
                self._selector.unregister(key.fileobj)
                self._emit(running, final=True)
                continue
            running.buffer += chunk
            self._emit(running)
        for r in self._running:
            if r.returncode is None and r.proc.poll() is not None:
                r.returncode = _exit_code(r.proc.returncode)

    def _emit(self, running: _Running, final: bool = False) -> None:
        *lines, running.buffer = running.buffer.split(b"\n")
        if final and running.buffer:
            lines.append(running.buffer)
            running.buffer = b""
        prefix = f"[{running.replica.label}] ".encode()
        data = b"".join(prefix + line + b"\n" for line in lines)
        if data:
            self.out.write(data)
            self.out.flush()

    def _wait(self, done: Callable[[_Running], bool], timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and any(
            r.returncode is None and not done(r) for r in self._running
        ):
            self._pump(0.05)

    def _teardown(self) -> None:
        """SIGTERM every process group still alive, wait ``grace``, SIGKILL the rest; relay their output."""
        alive = [r for r in self._running if r.returncode is None]
        for r in alive:
            _signal_group(r.proc.pid, signal.SIGTERM)
        self._wait(lambda r: False, timeout=self.grace if alive else 0)
        for r in self._running:
            if r.returncode is None:
                _say(f"{r.replica.label} ignored SIGTERM for {self.grace:g}s: SIGKILL")
            _signal_group(r.proc.pid, signal.SIGKILL)  # also reaps grandchildren left in the group
        for r in self._running:
            r.proc.wait()
            r.returncode = _exit_code(r.proc.returncode)
        deadline = time.monotonic() + 2.0  # a daemonised grandchild may hold a pipe open: stop relaying
        while self._selector.get_map() and time.monotonic() < deadline:
            self._pump(0.05)
        for key in list(self._selector.get_map().values()):
            self._selector.unregister(key.fileobj)
            self._emit(key.data, final=True)
        for r in self._running:
            r.proc.stdout.close()  # type: ignore[union-attr]
        self._running.clear()


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


def _free_ports(count: int) -> list[int]:
    import socket

    sockets = []
    try:
        for _ in range(count):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("127.0.0.1", 0))
            sockets.append(s)
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def _say(message: str) -> None:
    print(f"[local-run] {message}", file=sys.stderr, flush=True)


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text}")
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

"""The supervisor of a simulated job: starts the replicas, relays their output, judges the job by the chief,
signals and tears down as Vertex would, restarts; chaos faults come in through a :class:`FaultSource`.

Each replica has a local disk of its own, kept across restarts as a VM's disk is (a directory
under a temporary one, ``$VERTEXRT_LOCAL_CHECKPOINT_DIR`` in the replica, shared by the processes of one
replica); a lost VM (``lose_vm``, or a chaos fault with ``wipe``) loses it. A replica that stops a crash loop
(:data:`vertexrt.env.CRASH_LOOP_EXIT_CODE`) ends the job without a restart, as Vertex ends a job on a
permanent error."""

from __future__ import annotations

import contextlib
import ctypes
import os
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO, Protocol

from vertexrt._net import free_ports
from vertexrt.distributed import reaper
from vertexrt.distributed.local_run.environments import JobSpec, Replica, port_count, replica_environments
from vertexrt.distributed.local_run.relay import OutputRelay, say
from vertexrt.env import CRASH_LOOP_EXIT_CODE
from vertexrt.errors import ConfigError

_SETTLE_SECONDS = 5.0
#: Where a replica finds its local disk (a fast checkpoint tier reads it).
LOCAL_DISK_VARIABLE = "VERTEXRT_LOCAL_CHECKPOINT_DIR"


@dataclass
class _Running:
    replica: Replica
    proc: subprocess.Popen[bytes]
    returncode: int | None = None
    reported: bool = False


@dataclass(frozen=True)
class FaultNotice:
    """A fault that landed in a replica (it signalled itself, see :mod:`vertexrt.audit`): ``everyone``
    means Vertex preempts every replica (the others get SIGTERM now); the attempt ends ``grace`` seconds
    later at most; ``wipe``: the replica's VM is lost with its local disk."""

    replica: str
    everyone: bool
    grace: float
    wipe: bool = False


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


@dataclass(frozen=True)
class LostVM:
    """``--lose-vm REPLICA@SECONDS``: the replica (``workerpool1-0``) whose VM is lost, ``seconds`` after the
    first attempt started."""

    replica: str
    seconds: float


@dataclass
class Supervisor:
    """Starts the replicas, relays their output, judges the job by the chief, tears down, restarts."""

    job: JobSpec
    grace: float = 15.0
    preempt_after: float | None = None
    restarts: int = 0
    lose_vm: LostVM | None = None
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
    _disks: Path | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        self._relay = OutputRelay(self.out)

    def run(self) -> int:
        main_thread = threading.current_thread() is threading.main_thread()
        handled = (signal.SIGINT, signal.SIGTERM) if main_thread else ()
        previous = {s: signal.signal(s, self._on_signal) for s in handled}
        self._disks = Path(tempfile.mkdtemp(prefix="vertexrt-local-disks-"))
        self._watchdog = watchdog = _start_watchdog(self._run_id)
        try:
            attempt = 0
            while True:
                attempt += 1
                outcome, code = self._attempt(attempt, preempt=self.preempt_after if attempt == 1 else None)
                looping = [label for label, c in self.attempts[-1].codes.items() if c == CRASH_LOOP_EXIT_CODE]
                if outcome == "failed" and looping:
                    self.say(
                        f"{', '.join(looping)} stopped a crash loop (exit {CRASH_LOOP_EXIT_CODE}): a "
                        "permanent error, as Vertex treats it; no restart"
                    )
                    code = CRASH_LOOP_EXIT_CODE
                elif outcome in ("preempted", "failed") and attempt <= self.restarts:
                    self.say(f"{outcome}: restarting the whole job (restart {attempt} of {self.restarts})")
                    continue
                self.say(f"job {outcome} with exit code {code}")
                return code
        finally:
            shutil.rmtree(self._disks, ignore_errors=True)
            _stop_watchdog(watchdog)
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            self._selector.close()

    def say(self, message: str) -> None:
        self._relay.interrupt()  # our message on a line of its own, not after a replica's unfinished one
        say(message)

    def _on_signal(self, signum: int, _frame: object) -> None:
        self._stop_signal = signum

    def _attempt(self, attempt: int, preempt: float | None) -> tuple[str, int]:
        replicas = replica_environments(self.job, os.environ, free_ports(port_count(self.job)))
        for replica in replicas:
            replica.env[LOCAL_DISK_VARIABLE] = str(self._disk(replica.label))
        if self.faults is not None:
            for replica in replicas:
                replica.env.update(self.faults.environment(attempt, replica))
        codes: dict[str, int] = {}
        try:
            for replica in replicas:
                if not replica.runs:
                    self.say(f"{replica.label}: listed in CLUSTER_SPEC, not run locally")
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

    def _disk(self, label: str) -> Path:
        """The local disk of the replica (VM) that runs the process ``label`` (``workerpool0-0/1``)."""
        assert self._disks is not None, "a disk is asked for outside run()"
        disk = self._disks / label.split("/")[0]
        disk.mkdir(exist_ok=True)
        return disk

    def _lose_vm(self, replica: str) -> None:
        """SIGKILL every process of ``replica`` with no grace, wait for them, and wipe its local disk."""
        victims = [r for r in self._running if r.replica.label.split("/")[0] == replica]
        for r in victims:
            _signal_group(r.proc.pid, signal.SIGKILL)
        for r in victims:
            r.proc.wait()
        disk = self._disk(replica)
        shutil.rmtree(disk, ignore_errors=True)
        disk.mkdir()
        self.say(f"the VM of {replica} is lost: SIGKILL with no grace, its local disk wiped")

    def _watch(self, attempt: int, started: float, preempt: float | None) -> tuple[str, int]:
        lose = self.lose_vm if attempt == 1 else None
        while True:
            self._pump(0.1)
            if lose is not None and time.monotonic() - started >= lose.seconds:
                self._lose_vm(lose.replica)  # then judged as any replica's failure: teardown, restart
                lose = None
            notice = self.faults.notice(attempt) if self.faults is not None else None
            if notice is not None:
                return self._fault(notice)
            for r in self._running:
                if r.returncode is None or r.reported:
                    continue
                r.reported = True
                self.say(f"{r.replica.label} exited with code {r.returncode}")
                if r.returncode != 0 and r.replica.pool in ("workerpool0", "workerpool1"):
                    who = "the chief replica" if r.replica.on_chief_replica else "replica"
                    self.say(f"{who} {r.replica.label} failed: tearing down every replica")
                    return "failed", r.returncode
            chief = [r for r in self._running if r.replica.on_chief_replica]
            if chief and all(r.returncode == 0 for r in chief):  # none when stopped before it started
                return "succeeded", 0
            if self._stop_signal is not None:
                self.say(f"received signal {self._stop_signal}: tearing down every replica")
                return "interrupted", 128 + self._stop_signal
            if preempt is not None and time.monotonic() - started >= preempt:
                self.say(
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
        self.say(
            f"fault in {notice.replica}: "
            + ("SIGTERM to every replica" if notice.everyone else "that replica only")
            + f", {notice.grace:g}s grace"
        )
        self._wait(lambda r: False, timeout=notice.grace)
        outcome = self._preempted(self._keep(self._teardown(grace=0, waited=notice.grace)))
        if notice.wipe:
            disk = self._disk(notice.replica)
            shutil.rmtree(disk, ignore_errors=True)
            disk.mkdir()
            self.say(f"the VM of {notice.replica.split('/')[0]} is lost with its local disk: wiped")
        return outcome

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
            self.say("every replica exited 0 after the notice: the job finished, no restart")
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
                self.say(f"{r.replica.label} ignored SIGTERM: SIGKILLed after the {waited:g} s grace")
            elif not r.reported:
                self.say(f"{r.replica.label} exited with code {r.returncode}")
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

"""The tests' process runner: a test that starts a job, a process tree or ranks starts it through here.

- :func:`run_job`: a command as a user would run it, in its own process group, killed whole if it overruns.
- :func:`start_job`: the same, running while the test acts on it: wait for its output, signal it, then
  :meth:`Job.wait` with a deadline; whatever still runs when the ``with`` block ends is killed.
- :func:`run_tree`: a command that may start a process tree (``local-run``), stopped on cue, and proof that
  no process of the tree survives it.
- :func:`run_ranks`: one worker script as ``world`` real processes (gloo ranks) sharing one free port.

Jobs, trees and ranks time out on a :class:`StarvedDeadline`: a ceiling that a correct run meets on
an idle machine is not exceeded because other work kept the job's processes off the CPUs.

Worker scripts: a program a test starts (a rank, a training run, a replica) is a file in the ``scripts/``
folder beside the test (``tests/runtime/scripts/crash_at.py``, ``tests/scripts/...`` for top-level tests), run
by path with its inputs as arguments. An inline ``python -c`` string is for a probe of a few lines (what an
import loads); longer programs are not written into tests as strings.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import TypeVar

import pytest

from vertexrt._net import free_port

TESTS = Path(__file__).resolve().parent
T = TypeVar("T")


class Job:
    """A command started by :func:`start_job`, in its own process group; stdout (and stderr, merged or apart)
    read as it arrives, partial lines included."""

    def __init__(
        self, command: Sequence[str], cwd: Path | None, env: Mapping[str, str] | None, merge_stderr: bool
    ) -> None:
        self.command = list(command)
        self._proc = subprocess.Popen(
            self.command,
            cwd=cwd,
            env=None if env is None else dict(env),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT if merge_stderr else subprocess.PIPE,
            start_new_session=True,
        )
        self._stdout: list[bytes] = []
        self._stderr: list[bytes] = []
        self._arrived = threading.Condition()
        streams = [(self._proc.stdout, self._stdout), (self._proc.stderr, self._stderr)]
        self._readers = [
            threading.Thread(target=self._read, args=(stream, into), daemon=True)
            for stream, into in streams
            if stream is not None
        ]
        for reader in self._readers:
            reader.start()

    def _read(self, stream: object, into: list[bytes]) -> None:
        fd = stream.fileno()  # type: ignore[attr-defined]
        while chunk := os.read(fd, 1 << 16):
            with self._arrived:
                into.append(chunk)
                self._arrived.notify_all()
        with self._arrived:
            self._arrived.notify_all()

    @property
    def pid(self) -> int:
        return self._proc.pid

    @property
    def output(self) -> str:
        """Its stdout so far (with stderr, unless started with ``merge_stderr=False``)."""
        with self._arrived:
            return b"".join(self._stdout).decode(errors="replace")

    @property
    def errors(self) -> str:
        """Its stderr so far, when started with ``merge_stderr=False``."""
        with self._arrived:
            return b"".join(self._stderr).decode(errors="replace")

    def poll(self) -> int | None:
        return self._proc.poll()

    def signal(self, sig: int) -> None:
        """Send ``sig`` to the job's first process (not its group)."""
        self._proc.send_signal(sig)

    def kill(self) -> None:
        """SIGKILL the job's first process only: no teardown of its own runs."""
        self._proc.kill()
        self._proc.wait()

    def wait_for(self, ready: str | Callable[[str], bool], timeout: float) -> str:
        """Wait until :attr:`output` contains ``ready`` (or ``ready(output)`` is true) and return it; fail the
        test if the job's output ends first or ``timeout`` seconds pass."""
        check = ready if callable(ready) else (lambda out: ready in out)
        deadline = time.monotonic() + timeout
        with self._arrived:
            while True:
                output = b"".join(self._stdout).decode(errors="replace")
                if check(output):
                    return output
                left = deadline - time.monotonic()
                if left <= 0 or not any(r.is_alive() for r in self._readers):
                    break
                self._arrived.wait(min(left, 1.0))
        pytest.fail(f"{self.command}: no {ready!r} in its output after {timeout} s:\n{output[-5000:]}")

    def wait(self, timeout: float) -> subprocess.CompletedProcess[str]:
        """Wait for the job to exit and its output to end; on timeout its whole process group is killed and
        the test fails with the output's tail."""
        deadline = StarvedDeadline(timeout, lambda: group_members(self._proc.pid))
        try:
            deadline.run(self._proc.wait)
            for reader in self._readers:
                reader.join(max(deadline.remaining(), 0))
            if any(r.is_alive() for r in self._readers):
                raise subprocess.TimeoutExpired(self.command, timeout)
        except subprocess.TimeoutExpired:
            self._kill_group()  # a launcher's reaper then ends its replicas
            for reader in self._readers:
                reader.join(30)
            pytest.fail(
                f"{self.command} did not finish in {timeout} s:\n{self.output[-5000:]}{self.errors[-5000:]}"
            )
        return subprocess.CompletedProcess(self.command, self._proc.returncode, self.output, self.errors)

    def _kill_group(self) -> None:
        try:
            os.killpg(self._proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass  # the group is gone already
        self._proc.wait()

    def __enter__(self) -> Job:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        if self._proc.poll() is None:
            self._kill_group()


def start_job(
    command: Sequence[str],
    cwd: Path | None = None,
    env: Mapping[str, str] | None = None,
    *,
    merge_stderr: bool = True,
) -> Job:
    """Start ``command`` as a :class:`Job`; use it as a context manager so that it never outlives the test."""
    return Job(command, cwd, env, merge_stderr)


def run_job(
    command: list[str],
    cwd: Path | None,
    timeout: float,
    env: Mapping[str, str] | None = None,
    *,
    merge_stderr: bool = True,
) -> subprocess.CompletedProcess[str]:
    """Run ``command``, stdout and stderr merged (or apart with ``merge_stderr=False``, for tests that check
    what went to which); on timeout its whole process group is killed and the test fails with the output's
    tail. ``cwd=None``: the test's own."""
    with start_job(command, cwd, env, merge_stderr=merge_stderr) as job:
        return job.wait(timeout)


def group_members(pgid: int) -> list[int]:
    """PIDs of the live processes in process group ``pgid``."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat.rpartition(")")[2].split()  # state, ppid, pgrp, ...
        if len(fields) > 2 and fields[2] == str(pgid):
            pids.append(int(entry.name))
    return pids


def runqueue_seconds(pids: Iterable[int]) -> dict[int, float]:
    """Per thread of the processes ``pids``: the seconds it has spent runnable but waiting for a CPU (the
    second field of Linux's ``/proc/PID/task/TID/schedstat``); threads that are gone are left out."""
    waits = {}
    for pid in pids:
        try:
            tids = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue
        for tid in tids:
            try:
                fields = Path(f"/proc/{pid}/task/{tid}/schedstat").read_text().split()
                waits[int(tid)] = int(fields[1]) / 1e9
            except (OSError, IndexError, ValueError):
                continue
    return waits


class StarvedDeadline:
    """``seconds`` from now, plus the time the job's most delayed thread has waited for a CPU so far.

    A correct job's wall time is the time it needs plus the time its processes sat runnable while other
    work held the cores; on a loaded 2-core machine (load average 20-50) that second part is many times the
    first, so a fixed ceiling fails correct runs. A hung job (blocked in a collective, waiting for a peer
    that never comes) does not wait for a CPU, so it still ends at ``seconds``.
    """

    def __init__(self, seconds: float, pids: Callable[[], Iterable[int]]) -> None:
        self.seconds = seconds
        self._pids = pids
        self._start = time.monotonic()
        self._waits: dict[int, float] = {}

    def starved(self) -> float:
        """Seconds the most delayed thread of the job has waited for a CPU, over the threads seen so far."""
        self._waits.update(runqueue_seconds(self._pids()))
        return max(self._waits.values(), default=0.0)

    def remaining(self) -> float:
        return self._start + self.seconds + self.starved() - time.monotonic()

    def run(self, step: Callable[[float], T]) -> T:
        """``step(seconds)`` (e.g. ``proc.wait``, ``proc.communicate``) again each second while it raises
        ``subprocess.TimeoutExpired``, until it returns or the deadline passes.

        Raises:
            subprocess.TimeoutExpired: the deadline passed first.
        """
        while True:
            left = self.remaining()
            if left <= 0:
                raise subprocess.TimeoutExpired("the job", self.seconds)
            try:
                return step(min(left, 1.0))
            except subprocess.TimeoutExpired:
                continue


MARK = "VERTEXRT_TEST_MARK"
CLUSTER_VARIABLES = (
    "CLUSTER_SPEC",
    "TF_CONFIG",
    "MASTER_ADDR",
    "MASTER_PORT",
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "GROUP_WORLD_SIZE",
    "CLOUD_ML_TRIAL_ID",
)


@dataclass
class Run:
    returncode: int
    output: str

    def records(self) -> list[dict]:
        """Every ``RESULT {json}`` line, in output order."""
        return [
            json.loads(line.partition("RESULT ")[2])
            for line in self.output.splitlines()
            if "RESULT {" in line
        ]

    def results(self) -> dict[str, dict]:
        """The ``RESULT {json}`` line of each replica, keyed by its label (``chief``, ``worker-0``...)."""
        found = {}
        for line in self.output.splitlines():
            label, _, rest = line.partition("] RESULT ")
            if rest:
                found[label.lstrip("[")] = json.loads(rest)
        return found


def marked_processes(marker: str) -> list[int]:
    """PIDs of live processes whose environment carries ``marker``."""
    needle = f"{MARK}={marker}".encode()
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if needle in (entry / "environ").read_bytes():
                pids.append(int(entry.name))
        except OSError:
            continue
    return pids


def run_tree(
    argv: Sequence[str],
    *,
    timeout: float,
    cwd: Path,
    env: dict[str, str] | None = None,
    stop_after: float | None = None,
    stop_when: str | None = None,
    stop_delay: float = 0.0,
) -> Run:
    """Run ``argv`` (which may start a process tree) with a hard timeout, and fail the test if any process
    of the tree survives. SIGTERM it ``stop_after`` seconds after start, or ``stop_delay`` seconds after its
    output shows ``stop_when``."""
    marker = uuid.uuid4().hex
    full_env = {k: v for k, v in os.environ.items() if k not in CLUSTER_VARIABLES}
    full_env.update(env or {}, **{MARK: marker, "TF_CPP_MIN_LOG_LEVEL": "2", "PYTHONUNBUFFERED": "1"})
    proc = subprocess.Popen(argv, cwd=cwd, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    lines: list[bytes] = []
    seen = threading.Event()

    def read() -> None:
        for line in proc.stdout:  # type: ignore[union-attr]
            lines.append(line)
            if stop_when is not None and stop_when.encode() in line:
                seen.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        if stop_after is not None or stop_when is not None:
            if stop_when is not None:
                seen.wait(timeout)
                time.sleep(stop_delay)
            else:
                time.sleep(stop_after)  # type: ignore[arg-type]
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        try:
            StarvedDeadline(timeout, lambda: marked_processes(marker)).run(proc.wait)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            reader.join(5)
            output = b"".join(lines).decode(errors="replace")[-4000:]
            pytest.fail(
                f"{argv} timed out after {timeout}s (not counting its waits for a CPU); output:\n{output}"
            )
        reader.join(10)
    finally:
        leftovers = marked_processes(marker)
        for pid in leftovers:
            os.kill(pid, signal.SIGKILL)
        assert not leftovers, f"processes left behind by {argv}: {leftovers}"
    return Run(proc.returncode, b"".join(lines).decode(errors="replace"))


def run_ranks(
    script: str,
    world: int,
    argv: Callable[[int, int], list[str]],
    *,
    timeout: float = 120,
    env: Mapping[str, str] | None = None,
) -> list[tuple[int, str, str]]:
    """Run the Python file ``script`` as ``world`` real processes, ``argv(rank, port)`` each with one free
    port for all; (returncode, stdout, stderr) per rank, all waited for at most ``timeout`` seconds (a
    :class:`StarvedDeadline`). Every process is killed if the test gives up. The script's folder and
    ``tests/`` (``rank_exit``) are on its ``sys.path``; ``env`` (default: this process's) is the rest of its
    environment."""
    port = free_port()
    base = os.environ if env is None else env
    path = [os.path.dirname(os.path.abspath(script)), str(TESTS), base.get("PYTHONPATH", "")]
    env = dict(base, PYTHONPATH=os.pathsep.join(path))
    command = [sys.executable, script]
    procs = [
        subprocess.Popen(
            [*command, *argv(rank, port)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
        )
        for rank in range(world)
    ]
    deadline = StarvedDeadline(timeout, lambda: [proc.pid for proc in procs])
    try:
        outputs = [
            deadline.run(lambda seconds, proc=proc: proc.communicate(timeout=seconds)) for proc in procs
        ]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=30)
    return [(proc.returncode, out, err) for proc, (out, err) in zip(procs, outputs, strict=True)]

"""The tests' process runner: a test that starts a job, a process tree or ranks starts it through here.

- :func:`run_job`: a command as a user would run it, in its own process group, killed whole if it overruns.
- :func:`run_tree`: a command that may start a process tree (``local-run``), stopped on cue, and proof that
  no process of the tree survives it.
- :func:`run_ranks`: one worker script as ``world`` real processes (gloo ranks) sharing one free port.
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
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest

from vertexrt._net import free_port

TESTS = Path(__file__).resolve().parent


def run_job(
    command: list[str],
    cwd: Path,
    timeout: float,
    env: Mapping[str, str] | None = None,
    *,
    merge_stderr: bool = True,
) -> subprocess.CompletedProcess[str]:
    """Run ``command``, stdout and stderr merged (or apart with ``merge_stderr=False``, for tests that check
    what went to which); on timeout its whole process group is killed and the test fails with the output's
    tail."""
    proc = subprocess.Popen(
        command,
        cwd=cwd,
        env=None if env is None else dict(env),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT if merge_stderr else subprocess.PIPE,
        text=True,
        errors="replace",
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # a launcher's reaper then ends its replicas
        out, err = proc.communicate()
        pytest.fail(f"{command} did not finish in {timeout} s:\n{out[-5000:]}{(err or '')[-5000:]}")
    return subprocess.CompletedProcess(command, proc.returncode, out, err or "")


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
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            reader.join(5)
            output = b"".join(lines).decode(errors="replace")[-4000:]
            pytest.fail(f"{argv} timed out after {timeout}s; output:\n{output}")
        reader.join(10)
    finally:
        leftovers = marked_processes(marker)
        for pid in leftovers:
            os.kill(pid, signal.SIGKILL)
        assert not leftovers, f"processes left behind by {argv}: {leftovers}"
    return Run(proc.returncode, b"".join(lines).decode(errors="replace"))


def run_ranks(script: str, world: int, argv: Callable[[int, int], list[str]]) -> list[tuple[int, str, str]]:
    """Run the Python file ``script`` as ``world`` real processes, ``argv(rank, port)`` each with one free
    port for all; (returncode, stdout, stderr) per rank. Every process is killed if the test gives up. The
    script's folder and ``tests/`` (``rank_exit``) are on its ``sys.path``."""
    port = free_port()
    path = [os.path.dirname(os.path.abspath(script)), str(TESTS), os.environ.get("PYTHONPATH", "")]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(path))
    command = [sys.executable, script]
    procs = [
        subprocess.Popen(
            [*command, *argv(rank, port)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
        )
        for rank in range(world)
    ]
    try:
        outputs = [proc.communicate(timeout=120) for proc in procs]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=30)
    return [(proc.returncode, out, err) for proc, (out, err) in zip(procs, outputs, strict=True)]

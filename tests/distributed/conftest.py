"""Run ``local-run`` (and other process trees) with timeouts, and prove nothing is left behind."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).parent / "scripts"
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


@pytest.fixture
def local_run(tmp_path: Path) -> Callable[..., Run]:
    """``local_run("--workers", "2", "--", script, *args, timeout=120)``: the launcher as a subprocess.

    A script name without a slash is taken from ``tests/distributed/scripts`` and run with this Python.
    """

    def launch(*args: str, timeout: float = 120, env: dict[str, str] | None = None, **stop: object) -> Run:
        argv = list(args)
        split = argv.index("--")
        options, command = argv[:split], argv[split + 1 :]
        if command and command[0].endswith(".py") and "/" not in command[0]:
            command = [sys.executable, str(SCRIPTS / command[0]), *command[1:]]
        full = [
            sys.executable,
            "-m",
            "vertexrt.distributed.launcher",
            "--grace",
            "3",
            *options,
            "--",
            *command,
        ]
        return run_tree(full, timeout=timeout, cwd=tmp_path, env=env, **stop)  # type: ignore[arg-type]

    return launch

"""Running a job as a user would: a command in its own process group, killed whole if it overruns."""

from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import Mapping
from pathlib import Path

import pytest


def run_job(
    command: list[str], cwd: Path, timeout: float, env: Mapping[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """Run ``command`` (stdout and stderr merged); on timeout its whole process group is killed and the test
    fails with the output's tail."""
    proc = subprocess.Popen(
        command,
        cwd=cwd,
        env=None if env is None else dict(env),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        errors="replace",
        start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # a launcher's reaper then ends its replicas
        out, _ = proc.communicate()
        pytest.fail(f"{command} did not finish in {timeout} s:\n{out[-5000:]}")
    return subprocess.CompletedProcess(command, proc.returncode, out, "")

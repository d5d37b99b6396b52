"""examples/checkpoint_resume.py: killed (SIGKILL) or preempted (SIGTERM) runs resume to the same weights."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from jobs import run_job, start_job

EXAMPLE = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "checkpoint_resume.py")


def _run(directory: str, *extra: str) -> subprocess.CompletedProcess:
    command = [sys.executable, EXAMPLE, "--dir", directory, "--steps", "80", *extra]
    return run_job(command, Path(directory).parent, 120, merge_stderr=False)


def _interrupt(directory: str, sig: int, after_saves: int) -> subprocess.CompletedProcess[str]:
    slow = ["--steps", "80", "--every", "10", "--sleep", "0.02"]  # time to interrupt it
    command = [sys.executable, EXAMPLE, "--dir", directory, *slow]

    def saved(out: str) -> bool:
        lines = out.splitlines(keepends=True)
        return sum(line.startswith("saving step") and line.endswith("\n") for line in lines) >= after_saves

    with start_job(command, Path(directory).parent, merge_stderr=False) as job:
        job.wait_for(saved, 60)
        job.signal(sig)
        return job.wait(60)


@pytest.mark.slow
def test_killed_and_preempted_runs_resume_to_identical_weights(tmp_path):
    reference = _run(str(tmp_path / "straight"), "--every", "10")
    assert reference.returncode == 0, reference.stderr
    expected = reference.stdout.strip().splitlines()[-1]
    assert expected.startswith("done:")

    killed = _interrupt(str(tmp_path / "killed"), signal.SIGKILL, after_saves=4)
    assert killed.returncode == -signal.SIGKILL
    resumed = _run(str(tmp_path / "killed"), "--every", "10")
    assert resumed.returncode == 0, resumed.stderr
    assert resumed.stdout.startswith("resumed from step") and "step -1" not in resumed.stdout
    assert resumed.stdout.strip().splitlines()[-1] == expected

    preempted = _interrupt(str(tmp_path / "preempted"), signal.SIGTERM, after_saves=3)
    assert preempted.returncode == 143
    resumed = _run(str(tmp_path / "preempted"), "--every", "10")
    assert resumed.returncode == 0, resumed.stderr
    assert resumed.stdout.strip().splitlines()[-1] == expected

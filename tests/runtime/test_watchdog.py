"""The hang watchdog: a process that stops beating is ended with its stacks in the log; one that beats, or
never started beating, is left alone; a gloo job with a rank stuck in a collective fails fast and, with a
restart, resumes from its checkpoint and finishes."""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
from pathlib import Path

import pytest
from jobs import run_job

from vertexrt.errors import ConfigError
from vertexrt.phases import current_phase, long_phase
from vertexrt.runtime.watchdog import DEFAULT_TIMEOUT, HANG_EXIT_CODE, TIMEOUT_VARIABLE, hang_timeout

SCRIPTS = Path(__file__).parent / "scripts"
VERTEXRT = str(Path(sys.executable).parent / "vertexrt")


def _local_run(tmp_path: Path, *options: str, timeout: float) -> tuple[int, str]:
    """``vertexrt local-run OPTIONS -- python hang_collective.py`` as a user runs it; returns (rc, output)."""
    argv = [VERTEXRT, "local-run", "--grace", "3", *options]
    env = {
        k: v for k, v in os.environ.items() if k not in ("CLUSTER_SPEC", "TF_CONFIG", "RANK", "WORLD_SIZE")
    }
    done = run_job(argv, tmp_path, timeout, env)
    return done.returncode, done.stdout


def _run(mode: str, timeout: float, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, str(SCRIPTS / "hang.py"), mode, str(timeout)]
    return run_job(command, tmp_path, 120, merge_stderr=False)


def test_timeout_comes_from_the_argument_the_environment_or_the_default(monkeypatch) -> None:
    monkeypatch.delenv(TIMEOUT_VARIABLE, raising=False)
    assert hang_timeout() == DEFAULT_TIMEOUT
    monkeypatch.setenv(TIMEOUT_VARIABLE, "90")
    assert hang_timeout() == 90.0
    assert hang_timeout(5) == 5.0
    for off in ("0", "off", "OFF "):
        monkeypatch.setenv(TIMEOUT_VARIABLE, off)
        assert hang_timeout() is None
    assert hang_timeout(0) is None


@pytest.mark.parametrize("value", ["soon", "-5", "nan", "inf", "-inf", "1e12", "1e-320", "0.5"])
def test_a_bad_timeout_names_the_variable(monkeypatch, value: str) -> None:
    monkeypatch.setenv(TIMEOUT_VARIABLE, value)
    with pytest.raises(ConfigError, match=TIMEOUT_VARIABLE):
        hang_timeout()


def test_a_stuck_process_exits_with_the_hang_code_its_stacks_and_the_last_step(tmp_path) -> None:
    done = _run("stuck", 1.0, tmp_path)
    assert done.returncode == HANG_EXIT_CODE, done.stderr
    assert "FINISHED" not in done.stdout
    assert "ERROR" in done.stderr or "no training progress" in done.stderr
    assert "replica workerpool0-0 rank 0 (last completed step: 3)" in done.stderr
    assert "stuck_here" in done.stderr  # the main thread's stack, from faulthandler
    assert "vertexrt-hang-watchdog" in done.stderr or "_fire" in done.stderr  # every thread's


@pytest.mark.parametrize("mode", ["idle", "steady"])
def test_a_process_that_beats_or_never_beat_is_left_alone(tmp_path, mode: str) -> None:
    done = _run(mode, 1.0, tmp_path)
    assert done.returncode == 0, done.stderr
    assert "FINISHED" in done.stdout
    assert "no training progress" not in done.stderr


def test_a_hang_holding_the_gil_is_ended_by_the_backstop(tmp_path) -> None:
    done = _run("gil", 1.0, tmp_path)
    assert done.returncode != 0
    assert "FINISHED" not in done.stdout
    assert "Timeout" in done.stderr and "hang.py" in done.stderr  # faulthandler's dump of the stuck frame


@pytest.mark.slow
def test_a_rank_stuck_in_a_gloo_collective_fails_the_job_fast_with_stacks(tmp_path) -> None:
    script = [sys.executable, str(SCRIPTS / "hang_collective.py"), "--timeout", "3"]
    code, output = _local_run(tmp_path, "--workers", "2", "--", *script, timeout=180)
    assert code == HANG_EXIT_CODE, output[-4000:]
    chief = "\n".join(line for line in output.splitlines() if line.startswith("[workerpool0-0]"))
    assert "no training progress" in chief and "(last completed step: 4)" in chief, output[-4000:]
    assert "workerpool0-0 rank 0" in chief
    assert "all_reduce" in chief  # the stuck frame in the stack dump
    assert "gloo:all_reduce seq=5" in chief  # the flight recorder's newest collective
    assert "RESULT" not in output


@pytest.mark.slow
def test_a_job_that_hung_once_resumes_from_its_checkpoint_and_finishes(tmp_path) -> None:
    marker = tmp_path / "hung-once"
    script = [sys.executable, str(SCRIPTS / "hang_collective.py"), "--timeout", "6", "--once", str(marker)]
    code, output = _local_run(tmp_path, "--workers", "2", "--restarts", "1", "--", *script, timeout=240)
    assert code == 0, output[-4000:]
    assert marker.exists()
    assert "no training progress" in output
    results = {}
    for line in output.splitlines():
        label, _, rest = line.partition("] RESULT ")
        if rest:
            results[label.lstrip("[")] = json.loads(rest)
    assert set(results) == {"workerpool0-0", "workerpool1-0"}, output[-4000:]
    for record in results.values():
        assert record["step"] == 8
        assert record["first"] == 4  # resumed from the last checkpoint before the hang
        assert record["total"] == 16.0  # every step's all_reduce counted once


@pytest.mark.parametrize(
    "script, last_step",
    [("stuck_trainer.py", 3), ("stuck_loop.py", 2)],  # Trainer.fit(), and ctx.step() in a plain loop
)
def test_the_trainer_and_ctx_step_feed_the_process_watchdog(tmp_path, script, last_step) -> None:
    env = dict(os.environ, VERTEXRT_HANG_TIMEOUT="2", VERTEXRT_LOCAL_DIR=str(tmp_path))
    done = run_job([sys.executable, str(SCRIPTS / script)], tmp_path, 120, env, merge_stderr=False)
    assert done.returncode == HANG_EXIT_CODE, done.stderr[-3000:]
    assert "FINISHED" not in done.stdout
    assert f"(last completed step: {last_step})" in done.stderr, done.stderr[-3000:]
    assert "train_step" in done.stderr  # the stuck frame, from faulthandler


def _phases(mode: str, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, VERTEXRT_HANG_TIMEOUT="1", VERTEXRT_LOCAL_DIR=str(tmp_path))
    command = [sys.executable, str(SCRIPTS / "slow_phases.py"), mode, str(tmp_path)]
    return run_job(command, tmp_path, 120, env, merge_stderr=False)


@pytest.mark.parametrize("mode", ["first_step", "evaluate", "snapshot", "loader_startup", "counting"])
def test_a_healthy_slow_phase_is_not_a_hang(tmp_path, mode: str) -> None:
    """A slow first step (compilation), evaluate(), checkpoint snapshot, DataLoader worker start-up or
    ``equalize`` count takes longer than VERTEXRT_HANG_TIMEOUT without a step: the job goes on (exit 134
    would restart it into the same slow phase)."""
    done = _phases(mode, tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "FINISHED" in done.stdout
    assert "no training progress" not in done.stderr


def _ended(pid: int, within: float) -> bool:
    """True once process ``pid`` (not our child) has ended, waiting at most ``within`` seconds for it."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return True
    try:
        return bool(select.select([fd], [], [], within)[0])  # readable once the process has exited
    finally:
        os.close(fd)


def test_a_hang_does_not_leave_a_dataloader_worker_behind(tmp_path) -> None:
    done = _phases("orphan", tmp_path)
    pid = int((tmp_path / "worker.pid").read_text())
    try:
        assert done.returncode == HANG_EXIT_CODE, done.stderr[-3000:]
        assert "(last completed step: 1)" in done.stderr
        assert _ended(pid, within=30), f"DataLoader worker {pid} outlived its replica"
    finally:
        if not _ended(pid, within=0):
            os.kill(pid, 9)


def test_long_phases_nest_and_end_even_on_an_error() -> None:
    with long_phase("outer"):
        with pytest.raises(ValueError), long_phase("inner"):
            assert current_phase()[0] == "inner"
            raise ValueError("evaluation failed")
        assert current_phase()[0] == "outer"
    phase, ended = current_phase()
    assert phase is None and ended > 0.0

"""The crash-loop guard: the attempt log beside the checkpoints, how ``@main`` judges a failure against the
previous attempt, and the whole story under ``local-run`` with restarts (real processes)."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from jobs import run_job

from vertexrt import paths
from vertexrt.env import CRASH_LOOP_EXIT_CODE, TRANSIENT_EXIT_CODES
from vertexrt.errors import ConfigError
from vertexrt.runtime import Context, main
from vertexrt.runtime.attempts import Attempt, AttemptLog, fingerprint, guard

SCRIPT = Path(__file__).parent / "scripts" / "crash_at.py"


def _raise_in_a_helper(kind: type[Exception]) -> None:
    raise kind("boom")


def _error(kind: type[Exception] = ValueError) -> Exception:
    try:
        _raise_in_a_helper(kind)
    except Exception as err:
        return err
    raise AssertionError("unreachable")


def test_a_fingerprint_is_the_type_and_the_function_that_raised_without_line_or_message() -> None:
    err = _error()
    assert fingerprint(err) == "ValueError@runtime/test_attempts.py:_raise_in_a_helper"
    assert (
        fingerprint(_error(ConfigError))
        == "vertexrt.errors.ConfigError@runtime/test_attempts.py:_raise_in_a_helper"
    )
    assert fingerprint(ValueError("never raised")) == "ValueError"


def test_the_exit_code_of_a_crash_loop_is_permanent_on_vertex() -> None:
    assert CRASH_LOOP_EXIT_CODE not in TRANSIENT_EXIT_CODES  # those retry the whole job
    assert 0 < CRASH_LOOP_EXIT_CODE < 128  # not read as a death by signal (143 preempted, 137 killed)


def test_the_same_failure_at_the_same_step_is_a_loop_and_nothing_else_is(storage_root: str) -> None:
    log = AttemptLog.for_rank(storage_root, 0, job="42")
    judge = guard(storage_root, rank=0, replica="workerpool0-0", job="42")
    assert judge is not None
    assert judge.failed(_error(), step=7) is None  # the first failure
    assert judge.failed(_error(KeyError), step=7) is None  # another fingerprint
    assert judge.failed(_error(KeyError), step=8) is None  # another step
    message = judge.failed(_error(KeyError), step=8)
    assert message is not None and "crash loop: replica workerpool0-0 (rank 0)" in message
    assert "after step 8 with KeyError: 'boom'" in message and f"exits {CRASH_LOOP_EXIT_CODE}" in message
    judge.preempted(step=8)  # a preemption ends the chain
    assert judge.failed(_error(KeyError), step=8) is None
    previous = log.previous()
    assert previous is not None and (previous.outcome, previous.step, previous.job) == ("failed", 8, "42")
    assert log.directory == paths.join(storage_root, "attempts", "rank-0")


def test_an_attempt_of_another_job_is_not_compared(tmp_path: Path) -> None:
    AttemptLog.for_rank(str(tmp_path), 0, job="1").append(
        Attempt("failed", "1", 7, fingerprint(_error()), "ValueError: boom")
    )
    judge = guard(str(tmp_path), rank=0, replica="workerpool0-0", job="2")
    assert judge is not None and judge.failed(_error(), step=7) is None


@pytest.mark.parametrize(
    "content",
    [b"{not json", b'{"outcome": "exploded", "job": "42"}', b'{"outcome": "failed", "job": "42", "step": -1}',
     b"[1, 2]", b"x" * 20000, b"[" * 10000],
)  # fmt: skip
def test_a_corrupt_record_is_a_warning_and_a_fresh_log(
    storage_root: str, content: bytes, caplog: pytest.LogCaptureFixture
) -> None:
    log = AttemptLog.for_rank(storage_root, 3, job="42")
    log.append(Attempt("failed", "42", 7, fingerprint(_error()), "ValueError: boom"))
    bad = paths.join(log.directory, "99999999999999999999-1.json")  # the newest
    with paths.open(bad, "wb") as f:
        f.write(content)
    judge = guard(storage_root, rank=3, replica="workerpool1-2", job="42")
    assert judge is not None
    with caplog.at_level(logging.WARNING):
        assert judge.failed(_error(), step=7) is None  # the chain starts afresh
    assert "the attempt record" in caplog.text and "unreadable" in caplog.text and bad in caplog.text
    fs, path = paths.filesystem(bad)
    assert not fs.exists(path)
    assert judge.failed(_error(), step=7) is not None  # and goes on from there


def test_an_unreachable_log_is_a_warning_not_a_second_failure(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    blocker = tmp_path / "checkpoints"
    blocker.write_text("a file where the checkpoint directory should be")
    judge = guard(str(blocker), rank=0, replica="workerpool0-0", job="42")
    assert judge is not None
    with caplog.at_level(logging.WARNING):
        assert judge.failed(_error(), step=7) is None
    assert "cannot be used" in caplog.text


def test_the_guard_is_off_without_a_job_id_or_when_turned_off(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert guard(str(tmp_path), rank=0, replica="chief-0", job=None) is None
    monkeypatch.setenv("VERTEXRT_CRASH_LOOP_GUARD", "0")
    assert guard(str(tmp_path), rank=0, replica="chief-0", job="42") is None
    monkeypatch.setenv("VERTEXRT_CRASH_LOOP_GUARD", "maybe")
    with pytest.raises(ConfigError, match="VERTEXRT_CRASH_LOOP_GUARD='maybe'"):
        guard(str(tmp_path), rank=0, replica="chief-0", job="42")


def test_main_stops_the_second_identical_failure_with_the_crash_loop_exit(
    runtime_env: Any, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("CLOUD_ML_JOB_ID", "1234")
    monkeypatch.setenv("AIP_CHECKPOINT_DIR", str(tmp_path / "checkpoints"))

    @main(preflight=False)
    def train(ctx: Context) -> None:
        for step in range(1, 10):
            if step == 7:
                raise ValueError("a bad batch")
            ctx.step(step)

    with pytest.raises(ValueError):
        train()
    with pytest.raises(SystemExit) as stopped:
        train()
    assert stopped.value.code == CRASH_LOOP_EXIT_CODE
    assert "crash loop" in caplog.text and "failed after step 6 with ValueError: a bad batch" in caplog.text
    records = sorted((tmp_path / "checkpoints" / "attempts" / "rank-0").glob("*.json"))
    assert [json.loads(r.read_text())["step"] for r in records] == [6, 6]


def _local_run(tmp_path: Path, mode: str, restarts: int = 3) -> subprocess.CompletedProcess[str]:
    command = [
        sys.executable, "-m", "vertexrt.cli", "local-run", "--restarts", str(restarts), "--grace", "3",
        "--base-output-dir", str(tmp_path / "out"), "--", sys.executable, str(SCRIPT), mode,
    ]  # fmt: skip
    return run_job(command, tmp_path, 120, {**os.environ, "VERTEXRT_LOG_FORMAT": "text"})


@pytest.mark.slow
def test_a_deterministic_failure_stops_after_two_attempts_under_local_run(tmp_path: Path) -> None:
    done = _local_run(tmp_path, "always")
    assert done.returncode == CRASH_LOOP_EXIT_CODE, done.stdout[-3000:]
    assert "attempt 2" in done.stdout and "attempt 3" not in done.stdout, done.stdout[-3000:]
    assert done.stdout.count("crash loop: replica workerpool0-0 (rank 0) failed after step 6") == 1
    assert "stopped a crash loop (exit 93)" in done.stdout and "no restart" in done.stdout


@pytest.mark.slow
def test_a_failure_at_another_step_each_time_is_restarted(tmp_path: Path) -> None:
    done = _local_run(tmp_path, "moving")
    assert done.returncode == 0, done.stdout[-3000:]
    assert "attempt 3" in done.stdout and "finished" in done.stdout
    assert "crash loop" not in done.stdout


@pytest.mark.slow
def test_preemptions_never_count_as_crashes(tmp_path: Path) -> None:
    done = _local_run(tmp_path, "preempted")
    assert done.returncode == 0, done.stdout[-3000:]
    assert done.stdout.count("exited with code 143") == 2 and "attempt 4" in done.stdout
    assert "crash loop" not in done.stdout


def test_a_trainer_failing_at_the_same_step_is_stopped_on_its_second_attempt(
    runtime_env: Any, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    import torch

    from vertexrt.runtime import Trainer

    class FailsAtStep7(Trainer):
        def setup(self) -> None:
            self.model = torch.nn.Linear(1, 1)
            self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.1)
            self.train_data = [torch.ones(2, 1)] * 10

        def train_step(self, batch: Any) -> dict[str, Any]:
            if self.step + 1 == 7:
                raise ValueError("a bad batch")
            loss = self.model(batch).sum()
            self.optimizer.zero_grad()
            loss.backward()
            self.optimizer.step()
            return {"loss": loss.detach()}

    monkeypatch.setenv("CLOUD_ML_JOB_ID", "1234")
    monkeypatch.setenv("AIP_CHECKPOINT_DIR", str(tmp_path / "checkpoints"))

    @main(preflight=False)
    def train(ctx: Context) -> None:
        FailsAtStep7(ctx, max_epochs=1, progress_bar=False).fit()

    with pytest.raises(ValueError):
        train()
    with pytest.raises(SystemExit) as stopped:
        train()
    assert stopped.value.code == CRASH_LOOP_EXIT_CODE
    assert "failed after step 6 with ValueError: a bad batch [ValueError@" in caplog.text


def test_a_hang_after_the_same_step_twice_is_a_crash_loop_too(runtime_env: Any, tmp_path: Path) -> None:
    env = {
        **os.environ,
        "CLOUD_ML_JOB_ID": "77",
        "AIP_CHECKPOINT_DIR": str(tmp_path / "checkpoints"),
        "VERTEXRT_HANG_TIMEOUT": "1",
        "VERTEXRT_LOG_FORMAT": "text",
    }
    command = [sys.executable, str(SCRIPT.parent / "hang_after_step_3.py")]
    first = run_job(command, tmp_path, 60, env)
    assert first.returncode == 134, first.stdout[-3000:]  # the watchdog's own code: Vertex restarts it
    second = run_job(command, tmp_path, 60, env)
    assert second.returncode == CRASH_LOOP_EXIT_CODE, second.stdout[-3000:]
    assert "crash loop: replica" in second.stdout and "failed after step 3 with no progress" in second.stdout
    assert "[hang@" in second.stdout and "threading.py:wait]" in second.stdout


def test_a_failure_after_the_preemption_notice_is_not_a_crash(
    runtime_env: Any, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("CLOUD_ML_JOB_ID", "1234")
    monkeypatch.setenv("AIP_CHECKPOINT_DIR", str(tmp_path / "checkpoints"))

    @main(preflight=False)
    def train(ctx: Context) -> None:
        ctx.step(1)
        os.kill(os.getpid(), signal.SIGTERM)  # the notice; then a peer's exit breaks a collective
        assert ctx.should_stop()
        raise ConnectionResetError("peer closed the connection")

    for _ in range(2):  # the same error after the same step, twice: still no crash loop
        with pytest.raises(ConnectionResetError):
            train()
    records = sorted((tmp_path / "checkpoints" / "attempts" / "rank-0").glob("*.json"))
    assert [json.loads(r.read_text())["outcome"] for r in records] == ["preempted", "preempted"]

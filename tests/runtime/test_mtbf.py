"""The job's mean time between failures from the crash-loop guard's attempt log, and the Context handing it
to a ``YoungDaly`` save policy."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from vertexrt.checkpoint import CheckpointManager, EveryNSteps, YoungDaly
from vertexrt.checkpoint.policies import daly_interval
from vertexrt.runtime import Context
from vertexrt.runtime.attempts import Attempt, AttemptLog, guard, mean_time_between_failures


def attempt(outcome: str, started: float, ended: float, job: str = "77") -> Attempt:
    return Attempt(outcome, job, step=3, fingerprint="ValueError@a.py:f", time=ended, started=started)


def test_the_mtbf_is_the_uptime_per_failure_and_a_preemption_adds_uptime_only() -> None:
    records = [
        attempt("failed", 1000.0, 2000.0),  # up 1000 s
        attempt("preempted", 2100.0, 4100.0),  # up 2000 s, no failure
        attempt("failed", 4200.0, 7200.0),  # up 3000 s
        Attempt("failed", "77", time=9000.0),  # an older record without its start: not counted
    ]
    assert mean_time_between_failures(records) == (3000.0, 2)
    assert mean_time_between_failures(records[1:2]) is None  # no failure: nothing observed
    assert mean_time_between_failures([]) is None


def test_the_guard_records_when_its_attempt_started(tmp_path: Path) -> None:
    judge = guard(str(tmp_path), rank=0, replica="workerpool0-0", job="77")
    assert judge is not None
    judge.failed(ValueError("boom"), step=3)
    [record] = AttemptLog.for_rank(str(tmp_path), 0, job="77").history()
    assert record.started == judge.started and 0 < record.started <= record.time


def test_a_context_gives_a_young_daly_policy_the_mtbf_of_two_earlier_failures(
    vertex_env: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    vertex_env(job_id="77", base_output_dir=str(tmp_path / "base"))
    monkeypatch.delenv("VERTEXRT_MTBF", raising=False)
    ctx = Context.create()
    log = AttemptLog.for_rank(ctx.env.checkpoint_dir, 0, job="77")
    log.append(attempt("failed", 1000.0, 2000.0))
    log.append(attempt("preempted", 2100.0, 4100.0))
    log.append(attempt("failed", 4200.0, 7200.0))
    log.append(attempt("failed", 0.5, 1.0, job="another job"))  # not this job's

    policy = YoungDaly(save_seconds=30.0, mtbf_seconds=86_400.0, minimum=1, maximum=1e6)
    manager = CheckpointManager(str(tmp_path / "ckpt"), save_policy=policy | EveryNSteps(10_000))
    assert policy.mtbf() == 86_400.0  # the assumed value, until the context tells it
    ctx.checkpoints = manager
    assert policy.mtbf() == 3000.0  # 6000 s up, 2 failures
    assert policy.interval() == pytest.approx(daly_interval(30.0, 3000.0))
    ctx.close()

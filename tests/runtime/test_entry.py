"""@main: what the training function receives, and the exit codes (0, the user's error, 143)."""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
from pathlib import Path
from typing import Any

import pytest
from jobs import run_job, start_job

from vertexrt.errors import ConfigError
from vertexrt.runtime import PREEMPTED_EXIT_CODE, Context, Preempted, main


def test_passes_a_context_and_returns_the_result(runtime_env: Any) -> None:
    seen: list[Context] = []

    @main
    def train(ctx: Context) -> str:
        seen.append(ctx)
        return "done"

    assert train() == "done"
    ctx = seen[0]
    assert (ctx.rank, ctx.world_size, ctx.is_chief, ctx.framework, ctx.device) == (0, 1, True, None, "cpu")
    assert ctx.checkpoints.directory == ctx.env.checkpoint_dir
    assert ctx.replica == "chief-0"


def test_parses_arguments_the_hypertune_way(runtime_env: Any) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch_size", type=int, default=8)

    @main(parser=parser)
    def train(ctx: Context, args: argparse.Namespace) -> int:
        assert ctx.args is args
        return int(args.batch_size)

    assert train(["--batch_size=256.0"]) == 256


def test_user_error_is_reraised_naming_the_replica(
    runtime_env: Any, caplog: pytest.LogCaptureFixture
) -> None:
    @main
    def train(ctx: Context) -> None:
        raise KeyError("labels")

    with pytest.raises(KeyError) as raised:
        train()
    assert raised.value.__notes__ == ["vertexrt: raised on replica chief-0 (rank 0 of 1)"]
    assert "replica chief-0 (rank 0 of 1) failed: KeyError" in caplog.text


def test_sigterm_then_return_exits_143_and_restores_the_handler(runtime_env: Any) -> None:
    before = signal.getsignal(signal.SIGTERM)

    @main
    def train(ctx: Context) -> None:
        assert not ctx.should_stop()
        os.kill(os.getpid(), signal.SIGTERM)  # the flag handler is installed: the process lives on
        assert ctx.should_stop() and ctx.preempted

    with pytest.raises(Preempted) as raised:
        train()
    assert raised.value.code == PREEMPTED_EXIT_CODE == 143
    assert signal.getsignal(signal.SIGTERM) is before


def test_logging_is_set_up_for_the_call_only(runtime_env: Any, capsys: pytest.CaptureFixture[str]) -> None:
    root = logging.getLogger()
    handlers = list(root.handlers)

    @main(log_level="DEBUG")
    def train(ctx: Context) -> None:
        logging.getLogger("__main__").debug("inside")

    train()
    assert "[chief-0 r0] DEBUG __main__: inside" in capsys.readouterr().err
    assert root.handlers == handlers


def test_torch_framework_sets_up_the_process_group_and_device(runtime_env: Any) -> None:
    import torch
    import torch.distributed as dist

    @main(framework="torch")
    def train(ctx: Context) -> bool:
        assert ctx.device == torch.device("cpu")
        return dist.is_initialized()

    assert train() is True
    assert not dist.is_initialized()  # torn down by @main, which created it


def test_unknown_framework_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="framework='jax'"):
        main(framework="jax")


def test_vertex_log_format_is_json_lines_unless_asked(
    vertex_env: Any, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    vertex_env(base_output_dir=str(tmp_path / "base"), trial="4")

    @main
    def train(ctx: Context) -> None:
        logging.getLogger("__main__").info("hello")

    train()
    out = capsys.readouterr().out
    assert '"severity": "INFO"' in out and '"trial": "4"' in out and '"replica": "workerpool0-0"' in out
    monkeypatch.setenv("VERTEXRT_LOG_FORMAT", "text")
    train()
    assert "[workerpool0-0 r0] INFO __main__: hello" in capsys.readouterr().err


def test_warns_when_a_vertex_job_exports_nothing(
    vertex_env: Any, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    vertex_env(base_output_dir=str(tmp_path / "base"))

    @main
    def train(ctx: Context) -> None:
        pass

    train()
    assert "nothing was written to the model directory" in caplog.text
    caplog.clear()
    (tmp_path / "base" / "model").mkdir(parents=True, exist_ok=True)  # the preflight probe made it
    (tmp_path / "base" / "model" / "model.pt").write_bytes(b"weights")
    train()
    assert "nothing was written" not in caplog.text


SCRIPTS = Path(__file__).resolve().parent / "scripts"


@pytest.mark.parametrize("mode, code", [("ok", 0), ("fail", 1), ("preempt", 143)])
def test_exit_codes_of_a_real_process(runtime_env: Any, tmp_path: Path, mode: str, code: int) -> None:
    command = [sys.executable, str(SCRIPTS / "main_exit_codes.py"), mode]
    done = run_job(command, tmp_path, 120, merge_stderr=False)
    assert done.returncode == code, done.stderr
    if mode == "fail":
        assert "RuntimeError: bad batch" in done.stderr
        assert "vertexrt: raised on replica chief-0 (rank 0 of 1)" in done.stderr
    if mode == "preempt":
        assert "exiting 143 so the replica restarts" in done.stderr


@pytest.mark.slow
def test_tf_framework_creates_the_strategy_first(runtime_env: Any, tmp_path: Path) -> None:
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"}
    command = [sys.executable, str(SCRIPTS / "main_tf_strategy.py")]
    done = run_job(command, tmp_path, 180, env, merge_stderr=False)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "strategy _DefaultDistributionStrategy cpu" in done.stdout


def test_sigterm_never_polled_is_warned_about_and_exits_143(runtime_env: Any, tmp_path: Path) -> None:
    command = [sys.executable, str(SCRIPTS / "main_never_polls.py")]
    with start_job(command, tmp_path, merge_stderr=False) as job:
        first = job.wait_for(lambda out: "\n" in out, 120)
        assert first.splitlines()[0].strip() == "ready"
        job.signal(signal.SIGTERM)
        done = job.wait(120)
    stderr = done.stderr
    assert done.returncode == 143, stderr
    assert "arrived" in stderr and "s ago and the training function never checked ctx.should_stop()" in stderr
    assert "SIGTERM arrived at" in stderr and "nothing was saved at the notice" in stderr
    assert "exiting 143 (not 0)" in stderr


def test_logs_the_contract_checks_on_vertex(
    vertex_env: Any, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    vertex_env()  # no base output directory
    monkeypatch.delenv("AIP_CHECKPOINT_DIR", raising=False)
    monkeypatch.setattr("vertexrt.doctor._logged", set())  # preflight logs a warning once per process

    @main
    def train(ctx: Context) -> None:
        pass

    train()
    assert "AIP_CHECKPOINT_DIR is not set (the job has no baseOutputDirectory)" in caplog.text


def test_a_fatal_preflight_finding_stops_the_job_before_the_function_runs(
    runtime_env: Any, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("AIP_CHECKPOINT_DIR", "/sys/x")  # not writable, even by root
    ran: list[Context] = []

    @main
    def train(ctx: Context) -> None:
        ran.append(ctx)

    with pytest.raises(SystemExit) as stopped:
        train()
    assert stopped.value.code == 1 and ran == []
    assert "AIP_CHECKPOINT_DIR=/sys/x is not writable" in caplog.text and "replica chief-0" in caplog.text

    @main(preflight=False)
    def unchecked(ctx: Context) -> bool:
        return ctx._preflighted  # the Trainer does not run it either

    assert unchecked() is True


def test_preflight_failure_of_a_real_process_is_one_clear_message(runtime_env: Any, tmp_path: Path) -> None:
    env = {**os.environ, "AIP_CHECKPOINT_DIR": "/sys/x", "VERTEXRT_LOG_FORMAT": "text"}
    done = run_job(
        [sys.executable, str(SCRIPTS / "main_exit_codes.py"), "ok"], tmp_path, 120, env, merge_stderr=False
    )
    assert done.returncode == 1, done.stderr
    assert done.stderr.count("AIP_CHECKPOINT_DIR=/sys/x is not writable") == 1
    assert "Traceback" not in done.stderr


def test_a_tuning_trial_that_exports_nothing_is_not_warned_about(
    vertex_env: Any, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    vertex_env(base_output_dir=str(tmp_path / "base"), trial="7")

    @main
    def train(ctx: Context) -> None:
        pass

    with caplog.at_level(logging.INFO):
        train()
    said = [r for r in caplog.records if "nothing was written to the model directory" in r.getMessage()]
    assert [r.levelno for r in said] == [logging.INFO]


def test_tensorflow_options_reach_setup_tensorflow(runtime_env: Any) -> None:
    with pytest.raises(ConfigError, match="add framework='tf'"):
        main(strategy="mirrored")
    ran: list[Context] = []

    @main(framework="tf", strategy="no_such_strategy", legacy_keras=True)
    def train(ctx: Context) -> None:
        ran.append(ctx)

    with pytest.raises(ConfigError, match=r"setup_tensorflow\(strategy='no_such_strategy'\)"):
        train()
    assert ran == []


@pytest.mark.slow
def test_tf_multi_worker_job_sees_a_sigterm_on_every_rank_and_exits_143_after_a_save(tmp_path: Path) -> None:
    pytest.importorskip("tensorflow")
    from jobs import run_job

    script = Path(__file__).parent / "scripts" / "tf_main_sigterm.py"
    env = {k: v for k, v in os.environ.items() if k not in ("CLUSTER_SPEC", "TF_CONFIG")}
    env.update(VERTEXRT_LOG_FORMAT="text", TF_CPP_MIN_LOG_LEVEL="2")
    base = tmp_path / "out"
    command = [sys.executable, "-m", "vertexrt.cli", "local-run", "--workers", "2", "--base-output-dir"]
    done = run_job([*command, str(base), "--", sys.executable, str(script)], tmp_path, 240, env)
    results = [line.partition("] RESULT ")[2] for line in done.stdout.splitlines() if "] RESULT " in line]
    seen = sorted((r["rank"], r["stop"], r["replicas"]) for r in map(json.loads, results))
    assert seen == [(0, True, 2), (1, True, 2)], done.stdout[-4000:]  # both ranks under one MWMS
    assert done.stdout.count("exited with code 143") == 2 and done.returncode == PREEMPTED_EXIT_CODE
    assert (base / "checkpoints" / "step_0000000001" / "manifest.json").exists()  # saved before the exit

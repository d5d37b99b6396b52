"""The examples as users run them: real processes, under local-run (with a preemption) and torchrun."""

from __future__ import annotations

import importlib.util
import io
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from jobs import run_job

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
TORCH_EXAMPLE = EXAMPLES / "torch_classifier.py"

pytestmark = pytest.mark.slow


def run(command: list[str], cwd: Path, timeout: float = 240, **env: str) -> subprocess.CompletedProcess[str]:
    """``run_job`` with text logs (and ``env`` added to this environment)."""
    return run_job(command, cwd, timeout, {**os.environ, "VERTEXRT_LOG_FORMAT": "text", **env})


def local_run(
    tmp: Path, name: str, launcher_args: list[str], example_args: list[str]
) -> tuple[subprocess.CompletedProcess[str], Path]:
    """The torch example as a 2-replica job under ``vertexrt local-run``; the run and its output dir."""
    base = tmp / name
    command = [
        sys.executable, "-m", "vertexrt.cli", "local-run", "--workers", "2", "--base-output-dir", str(base),
        *launcher_args, "--", sys.executable, str(TORCH_EXAMPLE), "--record-log", str(base / "records"),
        *example_args,
    ]  # fmt: skip
    return run(command, cwd=tmp), base


def load_exported(model_dir: Path) -> dict[str, torch.Tensor]:
    spec = importlib.util.spec_from_file_location("torch_classifier", TORCH_EXAMPLE)
    assert spec is not None and spec.loader is not None
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    state = torch.load(io.BytesIO((model_dir / "model.pt").read_bytes()))
    net = example.build_model()
    net.load_state_dict(state)  # the exported model loads into a fresh model
    assert net(torch.zeros(2, example.FEATURES)).shape == (2, example.CLASSES)
    return state  # type: ignore[no-any-return]


def final_metrics(output: str) -> str:
    found = re.findall(r"final (accuracy=\S+ val_loss=\S+);", output)
    assert found, output[-3000:]
    return found[-1]


def test_torch_example_preempted_mid_epoch_resumes_to_the_same_weights(tmp_path: Path) -> None:
    started = time.monotonic()
    reference, ref_dir = local_run(tmp_path, "uninterrupted", [], [])
    assert reference.returncode == 0, reference.stdout[-5000:]
    elapsed = time.monotonic() - started

    # Preempt once the job is surely training: the first attempt holds at step 20 until the SIGTERM.
    preempt_after = f"{2 * elapsed + 10:.0f}"
    preempted, run_dir = local_run(
        tmp_path, "preempted", ["--preempt-after", preempt_after, "--grace", "60"], ["--hold-at-step", "20"]
    )
    out = preempted.stdout
    assert preempted.returncode == 0, out[-5000:]
    assert "preempting the job after" in out and "restarting the whole job" in out
    assert "preemption notice: saving the checkpoint of step" in out
    resumed = [int(s) for s in re.findall(r"resuming from \S+ \(step (\d+)\)", out)]
    assert len(resumed) == 1 and 0 < resumed[0] < 48, out[-5000:]  # mid-run (INFO lines: the chief's)

    for rank in (0, 1):  # the same records, in the same order, each exactly once per epoch
        assert (run_dir / "records" / f"rank{rank}.txt").read_text() == (
            ref_dir / "records" / f"rank{rank}.txt"
        ).read_text()
    expected = load_exported(ref_dir / "model")
    got = load_exported(run_dir / "model")
    assert all(torch.equal(expected[k], got[k]) for k in expected)  # bitwise
    assert json.loads((run_dir / "model" / "model.json").read_text())["trained_steps"] == 48
    assert final_metrics(out) == final_metrics(reference.stdout)


def test_torch_example_under_torchrun_with_tfrecord_data(tmp_path: Path) -> None:
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    done = run(
        [*torchrun, str(TORCH_EXAMPLE), "--format", "tfrecord", "--epochs", "1"],
        cwd=tmp_path,
        VERTEXRT_LOCAL_DIR=str(tmp_path / "out"),
        CLOUD_ML_HP_METRIC_FILE=str(tmp_path / "hp.metrics"),
    )
    assert done.returncode == 0, done.stdout[-5000:]
    assert "rank=0/2" in done.stdout
    shards = sorted(p.name for p in (tmp_path / "out" / "data").glob("train-*"))
    assert shards == [f"train-0000{i}-of-00004.tfrecord" for i in range(4)]
    load_exported(tmp_path / "out" / "model")
    assert json.loads((tmp_path / "out" / "model" / "model.json").read_text())["trained_steps"] == 16
    reports = [json.loads(line) for line in (tmp_path / "hp.metrics").read_text().splitlines()]
    assert [r["global_step"] for r in reports if "accuracy" in r] == ["16"]  # from the chief only


def test_plain_loop_example(tmp_path: Path) -> None:
    done = run(
        [sys.executable, str(EXAMPLES / "plain_loop.py"), "--epochs", "2"],
        cwd=tmp_path,
        VERTEXRT_LOCAL_DIR=str(tmp_path / "out"),
        CLOUD_ML_HP_METRIC_FILE=str(tmp_path / "hp.metrics"),
    )
    assert done.returncode == 0, done.stdout[-5000:]
    model: dict[str, Any] = json.loads((tmp_path / "out" / "model" / "model.json").read_text())
    assert model["steps"] == 4000
    assert model["weights"] == pytest.approx([2.0, -1.0, 0.5, 3.0], abs=0.1)
    reports = (tmp_path / "hp.metrics").read_text().splitlines()
    assert len(reports) == 2 and all('"mse"' in line for line in reports)

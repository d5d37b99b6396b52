"""examples/keras_classifier.py as a Vertex job would run it: `vertexrt local-run --workers 2` (tf-keras under
MultiWorkerMirroredStrategy, a vertexrt reader per worker), once straight through and once as a tuning trial
preempted by the launcher (`--preempt-after`) and restarted: both end with the same weights, bit for bit."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
from jobs import run_job

pytest.importorskip("tensorflow")
pytest.importorskip("tf_keras")

ROOT = Path(__file__).resolve().parents[2]
ARGS = ["--epochs", "4", "--steps_per_epoch", "50", "--checkpoint_every", "10"]


def _job(base: Path, *launcher_args: str, example_args: tuple[str, ...] = ()) -> str:
    env = {k: v for k, v in os.environ.items() if k not in ("CLUSTER_SPEC", "TF_CONFIG")}
    env.update(TF_CPP_MIN_LOG_LEVEL="2")
    cmd = [
        sys.executable, "-m", "vertexrt.cli", "local-run", "--workers", "2", *launcher_args,
        "--base-output-dir", str(base), "--",
        "env", f"CLOUD_ML_HP_METRIC_FILE={base / 'output.metrics'}",
        sys.executable, str(ROOT / "examples" / "keras_classifier.py"), *ARGS, *example_args,
    ]  # fmt: skip
    done = run_job(cmd, None, 500, env)
    assert done.returncode == 0, done.stdout[-8000:]
    return done.stdout


def _weights(log: str) -> str:
    return log.split("weights_sha256=")[1].split()[0]


@pytest.mark.slow
def test_keras_mwms_trial_preempted_and_restarted_ends_like_an_uninterrupted_run(tmp_path):
    reference = _job(tmp_path / "straight")
    log = _job(
        tmp_path / "trial",
        *("--trial", "7", "--preempt-after", "30", "--restarts", "1"),
        example_args=("--hold_at_step", "30"),  # preempted at step 30 however fast this machine is
    )
    assert "restarting the whole job" in log
    assert _weights(log) == _weights(reference)
    trial = tmp_path / "trial"
    assert list(trial.glob("**/model/saved_model.pb"))  # the chief's export, in the trial's model dir
    reports = [json.loads(line) for line in (trial / "output.metrics").read_text().splitlines()]
    assert reports[-1]["global_step"] == "4" and reports[-1]["trial"] == "7"

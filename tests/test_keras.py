"""vertexrt.keras callbacks in real TensorFlow processes: preempt mid-epoch, resume, same weights bit for bit.

Each training runs in its own process: the Keras flavour (`TF_USE_LEGACY_KERAS`) is fixed when
tf.keras is first used, and a preempted run ends with exit status 143.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

pytest.importorskip("tensorflow")

ROOT = Path(__file__).resolve().parents[1]
PREEMPTED = 128 + signal.SIGTERM

TRAIN = textwrap.dedent(
    """
    import json, os, signal, sys
    import numpy as np
    import tensorflow as tf
    from vertexrt import keras as vk
    from vertexrt.checkpoint import CheckpointManager, EveryNSteps

    ckpt_dir, out, kill_at, epochs = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    tf.keras.utils.set_random_seed(0)
    tf.config.experimental.enable_op_determinism()
    rng = np.random.default_rng(0)
    x = rng.normal(size=(96, 4)).astype("float32")
    y = (x[:, 0] + x[:, 1] > 0).astype("int64")
    model = tf.keras.Sequential([tf.keras.Input((4,)), tf.keras.layers.Dense(8, activation="relu"),
                                 tf.keras.layers.Dense(2)])
    model.compile(optimizer=tf.keras.optimizers.Adam(0.01),
                  loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"])
    manager = CheckpointManager(ckpt_dir, save_policy=EveryNSteps(3))
    ckpt = vk.CheckpointCallback(manager)
    position = ckpt.restore(model)
    # 6 batches per pass over the data, 5 steps per epoch: epochs and passes do not line up
    data = tf.data.Dataset.from_tensor_slices((x, y)).shuffle(96, seed=1).batch(16)
    data = data.repeat().skip(position.step)
    seen = []
    def on_batch(batch, logs):
        seen.append([int(model.optimizer.iterations.numpy()), batch])
        if int(model.optimizer.iterations.numpy()) == kill_at:
            os.kill(os.getpid(), signal.SIGTERM)
    record = tf.keras.callbacks.LambdaCallback(on_train_batch_end=on_batch)
    preemption = vk.PreemptionCallback(manager)
    try:
        model.fit(data, epochs=epochs, steps_per_epoch=5, verbose=0,
                  callbacks=[ckpt, preemption, vk.HypertuneCallback("accuracy"), record])
    finally:
        with open(out, "w") as f:
            json.dump({"position": list(position), "seen": seen, "preempted": preemption.preempted,
                       "iterations": int(model.optimizer.iterations.numpy()),
                       "weights": [w.tolist() for w in model.get_weights()]}, f)
    manager.close()
    """
)


def _run(tmp_path: Path, name: str, ckpt_dir: str, kill_at: int, legacy: bool, epochs: int = 3):
    """Start one training process; returns (process, result file, metric file)."""
    env = dict(os.environ)
    env.update(
        TF_USE_LEGACY_KERAS="1" if legacy else "0",
        TF_CPP_MIN_LOG_LEVEL="2",
        CLOUD_ML_HP_METRIC_FILE=str(tmp_path / name / "output.metrics"),
        CLOUD_ML_TRIAL_ID="5",
    )
    for var in ("CLUSTER_SPEC", "TF_CONFIG", "RANK", "WORLD_SIZE", "MASTER_ADDR"):
        env.pop(var, None)
    out = tmp_path / f"{name}.json"
    proc = subprocess.Popen(
        [sys.executable, "-c", TRAIN, ckpt_dir, str(out), str(kill_at), str(epochs)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    return proc, out, tmp_path / name / "output.metrics"


def _finish(proc, out: Path, expect: int) -> dict:
    try:
        log, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == expect, log[-3000:]
    return json.loads(out.read_text())


def _steps(metric_file: Path) -> list[str]:
    if not metric_file.exists():
        return []
    return [json.loads(line)["global_step"] for line in metric_file.read_text().splitlines()]


_REFERENCE: dict[bool, dict] = {}  # uninterrupted run per Keras flavour, shared by the storage variants


def _preempt_and_resume(tmp_path: Path, ckpt_dir: str, legacy: bool) -> None:
    # tf-keras resumes mid-epoch (killed after step 7: saved at step 8 = epoch 1, batch 3);
    # Keras 3 resumes at an epoch boundary only (killed after step 4: saved at step 5 = end of epoch 0).
    kill_at = 7 if legacy else 4
    full = None if legacy in _REFERENCE else _run(tmp_path, "full", str(tmp_path / "full"), -1, legacy)
    first = _run(tmp_path, "first", ckpt_dir, kill_at=kill_at, legacy=legacy)
    if full is not None:
        _REFERENCE[legacy] = _finish(*full[:2], expect=0)
    reference = _REFERENCE[legacy]
    interrupted = _finish(*first[:2], expect=PREEMPTED)
    assert interrupted["preempted"] is True
    assert interrupted["iterations"] == kill_at + 1  # stopped at the next batch boundary, not later

    second = _run(tmp_path, "second", ckpt_dir, kill_at=-1, legacy=legacy)
    resumed = _finish(*second[:2], expect=0)
    saved = kill_at + 1
    assert resumed["position"] == ([1, 3, saved] if legacy else [1, 0, saved])
    assert resumed["seen"][0] == [saved + 1, 3 if legacy else 0]  # the first batch run after the restart
    assert resumed["iterations"] == reference["iterations"] == 15
    assert resumed["weights"] == reference["weights"]  # bit for bit (floats survive JSON exactly)
    # hypertune: one report per complete epoch (step = epoch number); the preempted epoch is not reported
    assert _steps(first[2]) == (["1"] if legacy else [])
    assert _steps(second[2]) == ["2", "3"]


@pytest.mark.slow
def test_tf_keras_preempted_mid_epoch_resumes_exactly(tmp_path, storage_root):
    pytest.importorskip("tf_keras")
    _preempt_and_resume(tmp_path, storage_root.rstrip("/") + "/ckpt", legacy=True)


@pytest.mark.slow
def test_keras3_resumes_at_epoch_boundary_exactly(tmp_path):
    _preempt_and_resume(tmp_path, str(tmp_path / "ckpt"), legacy=False)


def _children(pid: int) -> list[int]:
    found = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        text = (task / "children").read_text().split()
        found += [int(p) for p in text]
    return found


@pytest.mark.slow
def test_example_multiworker_preempted_then_resumed(tmp_path):
    """examples/keras_classifier.py under `local-run --workers 2`: SIGTERM both workers once the first
    checkpoint is committed; the restarted job resumes from it and finishes."""
    pytest.importorskip("tf_keras")
    base = tmp_path / "out"
    env = {k: v for k, v in os.environ.items() if k not in ("CLUSTER_SPEC", "TF_CONFIG")}
    env.update(TF_CPP_MIN_LOG_LEVEL="2")
    metrics = tmp_path / "output.metrics"  # local-run scrubs CLOUD_ML_*: pass it through `env`
    cmd = [
        sys.executable, "-m", "vertexrt.cli", "local-run", "--workers", "2", "--restarts", "1",
        "--base-output-dir", str(base), "--",
        "env", f"CLOUD_ML_HP_METRIC_FILE={metrics}",
        sys.executable, str(ROOT / "examples" / "keras_classifier.py"),
        "--epochs", "3", "--steps_per_epoch", "30", "--checkpoint_every", "10",
    ]  # fmt: skip
    launcher = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 120
        while not list(base.glob("checkpoints/step_*/manifest.json")) and launcher.poll() is None:
            assert time.monotonic() < deadline, "no checkpoint was committed"
            time.sleep(0.05)
        for pid in _children(launcher.pid):
            os.kill(pid, signal.SIGTERM)  # a preemption: every replica at once
        log, _ = launcher.communicate(timeout=180)
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()
    assert launcher.returncode == 0, log[-4000:]
    assert "preemption: saving step" in log
    assert "restarting the whole job" in log
    assert "resumed from checkpoint step" in log
    assert "final val_accuracy=" in log
    accuracy = float(log.split("final val_accuracy=")[1].split()[0])
    assert accuracy > 0.8
    assert (base / "model" / "model.keras").exists()
    steps = [json.loads(line)["global_step"] for line in metrics.read_text().splitlines()]
    assert steps[-1] == "3"

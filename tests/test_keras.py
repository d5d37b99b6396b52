"""vertexrt.keras callbacks in real TensorFlow processes: preempt mid-epoch, resume, same weights bit for bit.

Each training runs in its own process: the Keras flavour (`TF_USE_LEGACY_KERAS`) is fixed when
tf.keras is first used, and a preempted run ends with exit status 143.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import textwrap
import time
from pathlib import Path

import pytest
from jobs import Job, run_job, start_job

pytest.importorskip("tensorflow")

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ROOT / "tests" / "scripts"
PREEMPTED = 128 + signal.SIGTERM


def _run(
    tmp_path: Path,
    name: str,
    ckpt_dir: str,
    kill_at: int,
    legacy: bool,
    epochs: int = 3,
    data_uri: str | None = None,
):
    """Start one training process; returns (job, result file, metric file)."""
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
    env.pop("DATA_URI", None)
    if data_uri is not None:
        env["DATA_URI"] = data_uri
    command = [sys.executable, str(SCRIPTS / "keras_train.py"), ckpt_dir, str(out), str(kill_at), str(epochs)]
    return start_job(command, env=env), out, tmp_path / name / "output.metrics"


def _finish(job: Job, out: Path, expect: int) -> dict:
    with job:
        done = job.wait(120)
    assert done.returncode == expect, done.stdout[-3000:]
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


def _write_records(path: Path, rows: int = 100) -> str:
    import numpy as np

    rng = np.random.default_rng(0)
    x = rng.normal(size=(rows, 4)).round(4)
    lines = [json.dumps({"x": row.tolist(), "y": int(row[0] + row[1] > 0)}) for row in x]
    path.write_text("\n".join(lines) + "\n")
    return str(path)


@pytest.mark.slow
@pytest.mark.parametrize("legacy", [True, False], ids=["tf_keras", "keras3"])
def test_reader_position_is_checkpointed_and_restored(tmp_path, legacy):
    """CheckpointCallback(data=reader): the checkpoint holds the reader's place and a restart continues with
    the next record not trained on: the same records, hence the same weights, as an uninterrupted run
    (tf-keras mid-epoch; Keras 3 at an epoch boundary)."""
    if legacy:
        pytest.importorskip("tf_keras")
    uri = _write_records(tmp_path / "train.jsonl")
    kill_at = 7 if legacy else 4
    full = _run(tmp_path, "full", str(tmp_path / "full"), -1, legacy, data_uri=uri)
    first = _run(tmp_path, "first", str(tmp_path / "ckpt"), kill_at, legacy, data_uri=uri)
    reference = _finish(*full[:2], expect=0)
    assert _finish(*first[:2], expect=PREEMPTED)["iterations"] == kill_at + 1
    resumed = _finish(*_run(tmp_path, "second", str(tmp_path / "ckpt"), -1, legacy, data_uri=uri)[:2], 0)
    assert resumed["position"] == ([1, 3, 8] if legacy else [1, 0, 5])
    assert resumed["iterations"] == reference["iterations"] == 15
    assert resumed["weights"] == reference["weights"]  # bit for bit


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
    with start_job(cmd, env=env) as launcher:
        deadline = time.monotonic() + 120
        while not list(base.glob("checkpoints/step_*/manifest.json")) and launcher.poll() is None:
            assert time.monotonic() < deadline, "no checkpoint was committed"
            time.sleep(0.05)
        for pid in _children(launcher.pid):
            os.kill(pid, signal.SIGTERM)  # a preemption: every replica at once
        done = launcher.wait(180)
    log = done.stdout
    assert done.returncode == 0, log[-4000:]
    assert "preemption: saving step" in log
    assert "restarting the whole job" in log
    assert "resuming from" in log
    assert "final val_accuracy=" in log
    accuracy = float(log.split("final val_accuracy=")[1].split()[0])
    assert accuracy > 0.8
    assert (base / "model" / "saved_model.pb").exists()  # the SavedModel Vertex serving loads
    steps = [json.loads(line)["global_step"] for line in metrics.read_text().splitlines()]
    assert steps[-1] == "3"


def _outputs(tmp_path: Path, root: str, **env_vars: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("CLUSTER_SPEC", "TF_CONFIG")}
    env.update(TF_CPP_MIN_LOG_LEVEL="2", **env_vars)
    out = tmp_path / "outputs.json"
    proc = run_job(
        [sys.executable, str(SCRIPTS / "keras_outputs.py"), root, str(out)],
        None,
        120,
        env,
        merge_stderr=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(out.read_text())


@pytest.mark.slow
def test_tensorboard_and_export_reach_the_output_dirs(tmp_path, storage_root):
    """vk.TensorBoard writes Keras's events locally and uploads them (gs:// against the emulator too);
    vk.export lands the chief's SavedModel in the model dir."""
    result = _outputs(tmp_path, storage_root)
    files = result["files"]
    assert result["where"] == storage_root.rstrip("/") + "/model"
    assert "/model/saved_model.pb" in files and any(f.startswith("/model/variables/") for f in files), files
    assert any(f.startswith("/logs/train/events.out.tfevents") for f in files), files
    assert any(f.startswith("/logs/validation/") for f in files) is False  # no validation data
    train_events = next(f for f in files if f.startswith("/logs/train/"))
    from vertexrt import paths

    with paths.open(storage_root.rstrip("/") + train_events, "rb") as f:
        assert b"epoch_loss" in f.read()  # what Keras logged, uploaded after fit


@pytest.mark.slow
def test_non_chief_saves_but_writes_nothing_to_the_output_dirs(tmp_path):
    """A non-chief worker runs model.save() (MWMS needs every worker to) and the TensorBoard callback, but
    nothing of it lands in the model or log dir, and its scratch directory is removed."""
    tf_config = {
        "cluster": {"chief": ["localhost:1"], "worker": ["localhost:2"]},
        "task": {"type": "worker", "index": 0},
    }
    root = tmp_path / "root"
    root.mkdir()
    result = _outputs(tmp_path, str(root), TF_CONFIG=json.dumps(tf_config))
    assert result["files"] == []
    assert result["where"] == str(root / "model")
    assert not os.path.exists(result["scratch"])


@pytest.mark.slow
def test_export_writes_a_servable_saved_model_of_a_lambda_model_under_tf_keras(tmp_path):
    """vk.export(model) of a tf-keras model whose Lambda closes over modules (a sample's "cannot pickle
    'module' object" after training): a SavedModel at the top of the model dir whose serving_default gives the
    model's outputs; filename="savedmodel" one in that subdirectory; a Keras file Keras cannot write
    (model.h5 here) becomes a SavedModel with a warning, never a failed trial; model.keras stays an option."""
    pytest.importorskip("tf_keras")
    env = {k: v for k, v in os.environ.items() if k not in ("CLUSTER_SPEC", "TF_CONFIG")}
    env.update(TF_USE_LEGACY_KERAS="1", TF_CPP_MIN_LOG_LEVEL="2")
    command = [sys.executable, str(SCRIPTS / "keras_lambda_export.py"), str(tmp_path)]
    proc = run_job(command, None, 120, env, merge_stderr=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.split("RESULT ", 1)[1])
    top = ["fingerprint.pb", "saved_model.pb", "variables"]  # where Vertex serving looks for saved_model.pb
    assert result["default"] == {"where": "default", "files": top, "served": True}
    assert result["named"] == {"where": "named/savedmodel", "files": ["savedmodel"], "served": True}
    assert result["h5"] == {"where": "h5/model", "files": ["model"], "served": True}
    assert "could not save model.h5 (TypeError: cannot pickle 'module' object)" in proc.stderr
    assert result["keras"] == {"where": "keras/model.keras", "files": ["model.keras"], "served": None}


@pytest.mark.slow
def test_a_stalled_tensorboard_upload_never_holds_a_preempted_exit(tmp_path, fault_proxy):
    """The PreemptionCallback saves and exits 143; the TensorBoard events' last upload (at exit) cannot reach
    Cloud Storage: the exit waits for it a bounded time instead of until Vertex's SIGKILL."""
    from vertexrt.tensorboard import PREEMPTED_UPLOAD_SECONDS

    fault_proxy.set("stall")  # every Cloud Storage request from now on gets no answer
    script = SCRIPTS / "keras_preempted_tensorboard.py"
    logs = f"gs://vertexrt-test/{tmp_path.name}/logs"
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", "VERTEXRT_HANG_TIMEOUT": "off"}
    done = run_job([sys.executable, str(script), str(tmp_path / "ckpt"), logs], tmp_path, 120, env)
    assert done.returncode == PREEMPTED, done.stdout[-3000:]
    assert (tmp_path / "ckpt").is_dir() and any((tmp_path / "ckpt").glob("step_*/manifest.json"))
    assert f"did not finish within {PREEMPTED_UPLOAD_SECONDS:.0f} s" in done.stdout


def _readme_keras_snippet() -> str:
    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("### Keras — `vertexrt.keras`") :]
    return section.split("```python\n", 1)[1].split("```", 1)[0]


@pytest.mark.slow
def test_the_readme_keras_snippet_ends_its_epochs(tmp_path):
    """The README's Keras snippet as written (its data local files): 2 epochs of one data epoch each,
    validation included, end; before, fit read the endless stream as one epoch forever."""
    for name, count in (("train-0.jsonl", 64), ("val-0.jsonl", 30)):
        lines = [json.dumps({"x": [i / 100, 1.0, -1.0, 0.5], "y": i % 3}) for i in range(count)]
        (tmp_path / name).write_text("\n".join(lines) + "\n")
    report = textwrap.dedent(
        """
        import json
        from vertexrt.errors import ConfigError
        try:  # without steps_per_epoch: refused at once, not an endless epoch
            model.fit(ckpt.as_tf(batch_size=16).map(xy), epochs=1, callbacks=[ckpt])
            refused = ""
        except ConfigError as err:
            refused = str(err)
        steps = int(model.optimizer.iterations.numpy())
        per_epoch = ckpt.steps_per_epoch(16)
        print("RESULT", json.dumps({"steps": steps, "per_epoch": per_epoch, "refused": refused}))
        """
    )
    (tmp_path / "snippet.py").write_text(_readme_keras_snippet() + report)
    env = {k: v for k, v in os.environ.items() if k not in ("CLUSTER_SPEC", "TF_CONFIG")}
    env.update(
        TF_CPP_MIN_LOG_LEVEL="2",
        AIP_TRAINING_DATA_URI=str(tmp_path / "train-*.jsonl"),
        AIP_VALIDATION_DATA_URI=str(tmp_path / "val-*.jsonl"),
        AIP_CHECKPOINT_DIR=str(tmp_path / "ckpt"),
        AIP_MODEL_DIR=str(tmp_path / "model"),
        AIP_TENSORBOARD_LOG_DIR=str(tmp_path / "logs"),
        CLOUD_ML_HP_METRIC_FILE=str(tmp_path / "output.metrics"),
    )
    done = run_job([sys.executable, str(tmp_path / "snippet.py")], tmp_path, 240, env)
    assert done.returncode == 0, done.stdout[-4000:]
    result = json.loads(done.stdout.split("RESULT ")[1].splitlines()[0])
    assert (result["steps"], result["per_epoch"]) == (2 * 4, 64 // 16)  # 2 epochs of one data epoch each
    assert "steps_per_epoch=ckpt.steps_per_epoch(batch_size)" in result["refused"]
    reports = (tmp_path / "output.metrics").read_text().splitlines()
    assert [json.loads(r)["global_step"] for r in reports] == ["1", "2"]  # val_accuracy each epoch
    assert (tmp_path / "model" / "saved_model.pb").exists()  # a SavedModel for Vertex serving

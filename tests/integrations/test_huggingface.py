"""The Hugging Face Trainer through vertexrt: checkpoints committed (marker last) to a local directory or a
bucket on the GCS server, preemption saves and exits 143, resumption gives the weights of an uninterrupted
run, hypertune gets metric_for_best_model; and the example as a preempted 2-replica job under local-run."""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from jobs import run_job, run_ranks

pytest.importorskip("transformers", reason="the huggingface extra (transformers) is not installed")
pytest.importorskip("accelerate", reason="the huggingface extra (accelerate) is not installed")
import torch  # noqa: E402
from transformers import Trainer, TrainerCallback, TrainingArguments  # noqa: E402

from vertexrt import paths  # noqa: E402
from vertexrt.errors import CheckpointError, ConfigError  # noqa: E402
from vertexrt.integrations.huggingface import (  # noqa: E402
    MARKER,
    VertexTrainerCallback,
    export_model,
    merge_file_lists,
)
from vertexrt.preemption.signals import preemption_signal

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "hf_trainer.py"


class Regression(torch.nn.Module):
    """A model the Trainer can train: returns {"loss": ...}; dropout exercises the restored RNG state."""

    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Dropout(0.2), torch.nn.Linear(16, 1))

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"loss": torch.nn.functional.mse_loss(self.net(x).squeeze(-1), labels)}


class Points(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    def __init__(self, n: int = 96, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, 4, generator=g)
        self.y = self.x.sum(dim=1)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"x": self.x[i], "labels": self.y[i]}


class SigtermAt(TrainerCallback):
    """Sends this process SIGTERM at the end of ``step`` (Vertex's preemption notice)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if state.global_step == self.step:
            os.kill(os.getpid(), signal.SIGTERM)


def train(
    vertex: VertexTrainerCallback,
    *extra: TrainerCallback,
    resume: str | None = None,
    max_steps: int = 12,
    **evaluation: Any,
) -> Trainer:
    evaluation = evaluation or {"eval_strategy": "steps", "eval_steps": 6}
    args = TrainingArguments(
        **vertex.training_arguments(
            max_steps=max_steps, per_device_train_batch_size=8, save_steps=4, save_total_limit=2, seed=0,
            data_seed=0, dataloader_num_workers=0, report_to="none", disable_tqdm=True, learning_rate=1e-2,
            metric_for_best_model="loss", **evaluation,
        )
    )  # fmt: skip
    torch.manual_seed(0)
    trainer = Trainer(model=Regression(), args=args, train_dataset=Points(), eval_dataset=Points(32, seed=1),
                      callbacks=[*extra, vertex])  # fmt: skip
    trainer.train(resume_from_checkpoint=resume)
    return trainer


@pytest.fixture
def job(clean_env: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "TENSORBOARD_LOGGING_DIR"):
        monkeypatch.setenv(name, "")  # recorded, so that what the callback exports is undone after the test
        monkeypatch.delenv(name)
    monkeypatch.setenv("CLOUD_ML_HP_METRIC_FILE", str(tmp_path / "hypertune" / "output.metrics"))
    return tmp_path


def test_preempted_run_commits_exits_143_and_resumes_to_the_uninterrupted_weights(
    job: Path, storage_root: str
) -> None:
    reference = train(VertexTrainerCallback(str(job / "reference"), metric="loss"))
    reports = [json.loads(line) for line in (job / "hypertune" / "output.metrics").read_text().splitlines()]
    assert [(r["global_step"], "loss" in r) for r in reports] == [("6", True), ("12", True)]

    output = paths.join(storage_root, "checkpoints")
    first = VertexTrainerCallback(output, staging_dir=str(job / "attempt1"))
    with pytest.raises(SystemExit) as stopped:
        train(first, SigtermAt(6))  # not a save step: the notice forces one
    assert stopped.value.code == 143
    assert first.complete_steps() == [4, 6]
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # the original handler is back

    second = VertexTrainerCallback(output, staging_dir=str(job / "attempt2"))  # a fresh machine
    resume = second.resume_from_checkpoint()
    assert resume is not None and resume.endswith("checkpoint-6") and os.path.isfile(f"{resume}/{MARKER}")
    resumed = train(second, resume=resume)
    assert resumed.state.global_step == 12
    expected, got = reference.model.state_dict(), resumed.model.state_dict()
    assert all(torch.equal(expected[k], got[k]) for k in expected)  # bitwise
    assert second.complete_steps() == [8, 12]  # save_total_limit=2 applies to output_dir too (remote or not)


@pytest.mark.parametrize(
    "evaluation",
    [{"eval_strategy": "steps", "eval_steps": 6}, {"eval_strategy": "epoch"}],
    ids=["steps", "epoch"],
)
def test_preempted_on_an_epochs_last_batch_resumes_the_next_epoch_to_the_uninterrupted_weights(
    job: Path, evaluation: dict[str, Any]
) -> None:
    """With evaluation each epoch, that evaluation must come before the preemption save: saved before it
    (also when a periodic save of that step exited), the resume skipped it and the random draw its
    DataLoader takes, so epoch 1's dropout masks differed (found by `local-run --chaos` on hf_trainer.py)."""
    reference = train(VertexTrainerCallback(str(job / "reference")), max_steps=24, **evaluation)  # 2 x 12
    first = VertexTrainerCallback(str(job / "preempted"))
    with pytest.raises(SystemExit):
        train(first, SigtermAt(12), max_steps=24, **evaluation)  # the notice at the last batch of epoch 0
    assert first.complete_steps() == [8, 12]
    second = VertexTrainerCallback(str(job / "preempted"))
    resumed = train(second, resume=second.resume_from_checkpoint(), max_steps=24, **evaluation)
    assert resumed.state.global_step == 24 and resumed.state.epoch == 2
    expected, got = reference.model.state_dict(), resumed.model.state_dict()
    assert all(torch.equal(expected[k], got[k]) for k in expected)  # bitwise


def test_commits_and_the_resume_are_audited_for_the_fault_certificate(
    job: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`local-run --chaos` reads these events: without them its report said "resumed from start" and
    "no save committed after the notice" for a run that resumed from its preemption save."""
    from vertexrt import audit

    monkeypatch.setenv(audit.DIRECTORY_VARIABLE, str(job / "audit"))
    monkeypatch.setenv(audit.REPLICA_VARIABLE, "workerpool0-0")
    monkeypatch.setenv(audit.PLAN_VARIABLE, "{}")
    audit.reset()
    try:
        train(VertexTrainerCallback(str(job / "ckpt")), max_steps=8)
        VertexTrainerCallback(str(job / "ckpt")).resume_from_checkpoint()
    finally:
        audit.reset()
    events = [json.loads(line) for line in (job / "audit" / "workerpool0-0.jsonl").read_text().splitlines()]
    assert [(e["event"], e["step"]) for e in events if e["event"] != "step"] == [
        ("commit", 4),
        ("commit", 8),
        ("resume", 8),
    ]


def test_ignore_data_skip_is_warned_about_when_training_starts(
    job: Path, caplog: pytest.LogCaptureFixture
) -> None:
    vertex = VertexTrainerCallback(str(job / "out"))
    args = TrainingArguments(**vertex.training_arguments(ignore_data_skip=True, report_to="none"))
    with caplog.at_level(logging.WARNING, logger="vertexrt.integrations.huggingface"):
        vertex.on_train_begin(args, None, None)
    vertex.on_train_end(args, None, None)
    assert "TrainingArguments(ignore_data_skip=True)" in caplog.text and "leave it False" in caplog.text


def test_resume_skips_a_step_without_a_valid_marker(job: Path, storage_root: str) -> None:
    output = paths.join(storage_root, "ckpt")
    vertex = VertexTrainerCallback(output, staging_dir=str(job / "stage"))
    trainer = train(vertex)
    assert vertex.complete_steps() == [8, 12]
    model = export_model(trainer, paths.join(storage_root, "model"))
    with paths.open(paths.join(model, "model.safetensors"), "rb") as f:
        assert len(f.read()) > 0
    with paths.open(paths.join(output, "checkpoint-12", MARKER), "wb") as f:
        f.write(b'{"step": 1')  # torn
    fs, uncommitted = paths.filesystem(paths.join(output, "checkpoint-8", MARKER))
    fs.rm(uncommitted)
    with paths.open(paths.join(output, "checkpoint-4", "config.json"), "wb") as f:
        f.write(b"{}")  # the files of a step that never got its marker
    assert vertex.complete_steps() == []
    assert VertexTrainerCallback(output, staging_dir=str(job / "other")).resume_from_checkpoint() is None


@pytest.mark.parametrize("staging", ["default", "reused"])
def test_a_commit_uploads_no_file_an_earlier_job_left_in_the_staging_dir(
    job: Path, gcs_server: Any, staging: str
) -> None:
    """Each rank uploads all of its local copy of a step, so a file left there was committed as this job's.
    The default staging dir was one per output URI and rank under /tmp, shared by every job writing to that
    URI on the machine, and by every run of the 2-replica example test below (pytest's tmp_path names
    repeat): each rank's held the whole checkpoints its resumes downloaded (rank 0's: rank 1's RNG state,
    uploaded after rank 1's own), and concurrent runs deleted and replaced each other's files there."""
    output = f"gs://{gcs_server.bucket}/{job.name}/ckpt"
    where = {"staging_dir": str(job / "stage")} if staging == "reused" else {}
    earlier = VertexTrainerCallback(output, **where)
    train(earlier, max_steps=4)
    fs, root = paths.filesystem(output)
    fs.invalidate_cache()
    committed = sorted(name.rsplit("/", 1)[-1] for name in fs.ls(f"{root}/checkpoint-4", detail=False))
    assert "rng_state_1.pth" not in committed and MARKER in committed
    # what a 2-replica job's resume leaves in rank 0's copy: the whole step, rank 1's RNG state included
    left = Path(earlier.local_dir) / "checkpoint-4"
    (left / "rng_state_1.pth").write_bytes((left / "rng_state.pth").read_bytes())
    fs.rm(root, recursive=True)  # the next job (or the test's next run) starts on an empty bucket

    later = VertexTrainerCallback(output, **where)
    assert later.resume_from_checkpoint() is None
    train(later, max_steps=4)
    fs.invalidate_cache()
    uploaded = sorted(name.rsplit("/", 1)[-1] for name in fs.ls(f"{root}/checkpoint-4", detail=False))
    assert uploaded == committed, (
        f"committed files an earlier job left: {sorted(set(uploaded) - set(committed))}"
    )


def objects(output: str, step: int) -> dict[str, int]:
    """The objects of ``checkpoint-<step>`` on the bucket: name → bytes (one fresh listing)."""
    fs, root = paths.filesystem(f"{output}/checkpoint-{step}")
    fs.invalidate_cache()
    return {path.rsplit("/", 1)[-1]: int(info["size"]) for path, info in fs.find(root, detail=True).items()}


@pytest.mark.parametrize("damage", ["deleted", "truncated"])
def test_resume_falls_back_past_a_committed_step_whose_rng_state_is_missing_or_truncated(
    job: Path, gcs_server: Any, caplog: pytest.LogCaptureFixture, damage: str
) -> None:
    """The Trainer resumes without a missing RNG (or optimizer) file and says so only at INFO level: the
    weights then silently differ from an uninterrupted run. The marker lists every file with its size."""
    output = f"gs://{gcs_server.bucket}/{job.name}/ckpt"
    vertex = VertexTrainerCallback(output, staging_dir=str(job / "stage"))
    train(vertex, max_steps=8)
    on_bucket = objects(output, 8)
    with paths.open(f"{output}/checkpoint-8/{MARKER}", "rb") as f:
        marker = json.loads(f.read())
    assert marker["step"] == 8 and "rng_state.pth" in marker["files"]
    assert marker["files"] == {name: size for name, size in on_bucket.items() if name != MARKER}

    rng = f"{output}/checkpoint-8/rng_state.pth"
    fs, path = paths.filesystem(rng)
    if damage == "deleted":
        fs.rm(path)
    else:
        with paths.open(rng, "rb") as f:
            head = f.read(on_bucket["rng_state.pth"] // 2)
        with paths.open(rng, "wb") as f:
            f.write(head)
    second = VertexTrainerCallback(output, staging_dir=str(job / "attempt2"))
    assert second.complete_steps() == [4, 8]  # committed, but not usable
    with caplog.at_level(logging.WARNING, logger="vertexrt.integrations.huggingface"):
        resume = second.resume_from_checkpoint()
    assert resume is not None and resume.endswith("checkpoint-4")
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("checkpoint-8" in m and "rng_state.pth" in m for m in warned), warned
    said = "is missing" if damage == "deleted" else f"has {len(head)} bytes, not the"
    assert said in warned[-1], warned

    fs.rm(paths.filesystem(f"{output}/checkpoint-4/optimizer.pt")[1])  # no step checks out: no fresh start
    with pytest.raises(CheckpointError, match=r"checkpoint-8: rng_state.pth.*checkpoint-4: optimizer.pt"):
        VertexTrainerCallback(output, staging_dir=str(job / "attempt3")).resume_from_checkpoint()


def test_a_step_committed_before_markers_listed_files_resumes_unchecked(job: Path, gcs_server: Any) -> None:
    """A marker of an older vertexrt holds only the step: such a step is resumed as then (not verified)."""
    output = f"gs://{gcs_server.bucket}/{job.name}/ckpt"
    train(VertexTrainerCallback(output, staging_dir=str(job / "stage")), max_steps=4)
    with paths.open(f"{output}/checkpoint-4/{MARKER}", "wb") as f:
        f.write(json.dumps({"step": 4}).encode())
    resume = VertexTrainerCallback(output, staging_dir=str(job / "again")).resume_from_checkpoint()
    assert (
        resume is not None and resume.endswith("checkpoint-4") and os.path.isfile(f"{resume}/rng_state.pth")
    )


def test_a_step_is_not_committed_when_an_uploaded_file_is_not_on_the_bucket(
    job: Path, gcs_server: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An upload that lost a file (injected: the object is removed right after the copy) gets no marker."""
    output = f"gs://{gcs_server.bucket}/{job.name}/ckpt"
    upload = paths.upload

    def losing_the_rng_state(local: str, uri: str, **kwargs: Any) -> list[str]:
        written = upload(local, uri, **kwargs)
        fs, path = paths.filesystem(f"{uri}/rng_state.pth")
        fs.rm(path)
        return written

    monkeypatch.setattr(paths, "upload", losing_the_rng_state)
    vertex = VertexTrainerCallback(output, staging_dir=str(job / "stage"))
    installed_before = preemption_signal().installed
    with pytest.raises(CheckpointError, match=r"checkpoint-4 not committed .*rng_state.pth is missing"):
        train(vertex, max_steps=4)
    assert MARKER not in objects(output, 4) and vertex.complete_steps() == []
    # training ended by the error, without on_train_end: the SIGTERM subscription was given back anyway (it
    # leaked once, and every later preemption test in the process saw a stale handler)
    assert preemption_signal().installed == installed_before


TWO_RANKS = """
import os, sys
rank, port, output, stage = sys.argv[1:]
os.environ.update(RANK=rank, WORLD_SIZE="2", LOCAL_RANK=rank, LOCAL_WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                  MASTER_PORT=port)
sys.path.insert(0, os.path.dirname(os.path.abspath({test!r})))
from test_huggingface import train
from vertexrt.integrations.huggingface import VertexTrainerCallback
train(VertexTrainerCallback(output, staging_dir=stage + rank), max_steps=4)
"""


@pytest.mark.slow  # ~50 s on the loaded 2-core machine (two transformers imports, gloo DDP)
def test_two_ranks_commit_a_marker_that_lists_both_ranks_files(job: Path, gcs_server: Any) -> None:
    """Each rank uploads its own files (rank 1: its RNG state); the marker lists what every rank uploaded."""
    output = f"gs://{gcs_server.bucket}/{job.name}/ckpt"
    script = job / "two_ranks.py"
    script.write_text(TWO_RANKS.format(test=__file__))
    argv = lambda rank, port: [str(rank), str(port), output, str(job / "stage")]  # noqa: E731
    for code, _, err in run_ranks(str(script), 2, argv, timeout=120):
        assert code == 0, err[-3000:]
    with paths.open(f"{output}/checkpoint-4/{MARKER}", "rb") as f:
        files = json.loads(f.read())["files"]
    assert {"rng_state_0.pth", "rng_state_1.pth", "model.safetensors", "optimizer.pt"} <= set(files)
    assert files == {name: size for name, size in objects(output, 4).items() if name != MARKER}
    assert not any(name.startswith("rng_state_1") for name in os.listdir(job / "stage0" / "checkpoint-4"))


def test_every_ranks_files_are_merged_into_one_list_and_a_conflict_is_an_error() -> None:
    rank0 = {"model.safetensors": 900, "optimizer.pt": 1800, "rng_state_0.pth": 14}
    assert merge_file_lists([rank0, {"rng_state_1.pth": 15}]) == {**rank0, "rng_state_1.pth": 15}
    assert merge_file_lists([rank0, rank0]) == rank0  # one shared local directory listed by every rank
    with pytest.raises(CheckpointError, match="rank 1 wrote optimizer.pt with 7 bytes"):
        merge_file_lists([rank0, {"optimizer.pt": 7}])


def test_training_arguments_and_the_callback_must_agree_on_output_dir(job: Path) -> None:
    vertex = VertexTrainerCallback("gs://bucket/run/ckpt", staging_dir=str(job / "stage"))
    fields = vertex.training_arguments(seed=3)
    assert fields == {
        "output_dir": str(job / "stage"),
        "use_cpu": not torch.cuda.is_available(),
        "ddp_find_unused_parameters": False,  # HF's default (True) warns at every DDP run
        "seed": 3,
    }
    assert vertex.training_arguments(ddp_find_unused_parameters=True)["ddp_find_unused_parameters"] is True
    assert os.environ["TENSORBOARD_LOGGING_DIR"].endswith(
        "logs"
    )  # the local fallback of AIP_TENSORBOARD_LOG_DIR
    args = TrainingArguments(output_dir=str(job / "elsewhere"), report_to="none")
    with pytest.raises(ConfigError, match="output_dir"):
        vertex.on_train_begin(args, None, None)


def local_run(tmp: Path, base: str, launcher: list[str], args: list[str]) -> subprocess.CompletedProcess[str]:
    job = ["local-run", "--workers", "2", "--base-output-dir", base, *launcher]
    command = [sys.executable, "-m", "vertexrt.cli", *job, "--", sys.executable, str(EXAMPLE), *args]
    return run_job(command, tmp, timeout=500)


@pytest.mark.slow
def test_example_two_replicas_preempted_resumes_to_the_same_weights(tmp_path: Path, gcs_server: Any) -> None:
    started = time.monotonic()
    reference = local_run(tmp_path, str(tmp_path / "reference"), [], ["--epochs", "1"])
    assert reference.returncode == 0, reference.stdout[-5000:]
    elapsed = time.monotonic() - started
    # on the bucket: each replica stages locally and uploads its files; the first attempt holds at step 5
    # (saves are at 10, 20, ...) until the SIGTERM; the ranks agree to stop within ~2 vote intervals (0.1 s
    # each), which is a few steps later when steps take milliseconds
    bucket = f"gs://{gcs_server.bucket}/{tmp_path.name}"
    preempted = local_run(tmp_path, bucket, ["--preempt-after", f"{2 * elapsed + 10:.0f}", "--grace", "60"],
                          ["--epochs", "1", "--hold-at-step", "5"])  # fmt: skip
    out = preempted.stdout
    assert preempted.returncode == 0, out[-5000:]
    assert "preemption notice: saving" in out and "restarting the whole job" in out, out[-5000:]
    assert "resuming from" in out and "done: 16 steps" in out, out[-5000:]
    forced = re.search(r"preemption notice: saving checkpoint-(\d+)", out)
    resumed_at = re.search(r"resuming from \S+checkpoint-(\d+)", out)
    assert forced and 5 <= int(forced.group(1)) < 16, out[-5000:]  # after the hold, mid-epoch
    assert resumed_at and resumed_at.group(1) == forced.group(1), out[-5000:]  # the forced save
    expected = torch.load(tmp_path / "reference" / "model" / "model.pt")
    with paths.open(f"{bucket}/model/model.pt", "rb") as f:
        got = torch.load(f)
    differ = [k for k in expected if not torch.equal(expected[k], got[k])]  # bitwise
    # failed once in CI (1 in 5 runs); every forced step 5..15 gives the same weights: the likely cause is
    # a staging dir shared with other runs (see test_a_commit_uploads_no_file_an_earlier_job_left_in_...)
    assert not differ, (
        f"saved at step {forced.group(1)}: {len(differ)} tensors differ: {differ[:4]}",
        out[-6000:],
    )

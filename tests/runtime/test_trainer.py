"""Trainer.fit(): resume after a real SIGTERM gives the uninterrupted result, on local disk and gs://."""

from __future__ import annotations

import json
import logging
import os
import random
import signal
import sys
import textwrap
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from jobs import run_job, run_ranks
from torch.utils.data import DataLoader

import vertexrt.data
import vertexrt.data.torch
from vertexrt import paths
from vertexrt._net import free_port
from vertexrt.checkpoint import CheckpointManager, EveryNSteps
from vertexrt.errors import ConfigError, DataError
from vertexrt.runtime import Context, Preempted, Trainer

SCRIPTS = Path(__file__).resolve().parent / "scripts"


def collate(records: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
    return {
        "id": torch.tensor([r["id"] for r in records]),
        "x": torch.tensor([r["x"] for r in records]),
        "y": torch.tensor([r["y"] for r in records]),
    }


class Regression(Trainer):
    """10 steps per epoch; every step draws from torch's, numpy's (tracked) and Python's RNGs."""

    def __init__(
        self,
        ctx: Context,
        data: str,
        *,
        preempt_at: int | None = None,
        preempt_in_eval: tuple[int, int] | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(ctx, progress_bar=False, **kwargs)
        self.data, self.preempt_at, self.preempt_in_eval = data, preempt_at, preempt_in_eval
        self.seen: list[int] = []
        self.evaluations: list[int] = []
        self.exported: list[str] = []

    def setup(self) -> None:
        torch.manual_seed(0)
        random.seed(0)
        self.model = torch.nn.Linear(3, 1)
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.05, momentum=0.9)
        self.noise = np.random.default_rng(7)
        reader = vertexrt.data.open_dataset(self.data, "jsonl", seed=3, shuffle_buffer=8, prefetch=0)
        self.train_data = DataLoader(reader.as_torch(), batch_size=4, collate_fn=collate)

    def train_step(self, batch: dict[str, torch.Tensor]) -> dict[str, Any]:
        self.seen += batch["id"].tolist()
        jitter = 0.01 * (torch.randn(batch["x"].shape) + float(self.noise.normal()) + random.random())
        loss = ((self.model(batch["x"] + jitter).squeeze(1) - batch["y"]) ** 2).mean()
        self.optimizer.zero_grad()
        loss.backward()
        self.optimizer.step()
        if self.step + 1 == self.preempt_at:
            os.kill(os.getpid(), signal.SIGTERM)
        return {"loss": loss.detach()}

    def evaluate(self) -> dict[str, float]:
        for n, _ in enumerate(self.interruptible(range(3)), start=1):
            if (self.step, n) == self.preempt_in_eval:
                os.kill(os.getpid(), signal.SIGTERM)
        self.evaluations.append(self.step)
        return {"score": float(self.step)}

    def export(self, model_dir: str) -> None:
        self.exported.append(model_dir)


def run(trainer_cls: type[Regression], root: str, data: str, **kwargs: Any) -> tuple[Regression, int]:
    """fit() with a SIGTERM handler as @main installs it; returns the trainer and the exit code."""
    ctx = Context.create()
    ctx.install_preemption_handler()
    ctx.checkpoints = CheckpointManager(paths.join(root, "ckpt"), save_policy=EveryNSteps(5))
    trainer = trainer_cls(ctx, data, max_epochs=kwargs.pop("max_epochs", 3), **kwargs)
    try:
        trainer.fit()
        code = 0
    except Preempted as stop:
        code = int(stop.code)  # type: ignore[arg-type]
    finally:
        ctx.close()
    return trainer, code


def assert_same_training(a: Regression, b: Regression) -> None:
    for name, tensor in a.model.state_dict().items():
        assert torch.equal(tensor, b.model.state_dict()[name]), name
    momentum_a = [s["momentum_buffer"] for s in a.optimizer.state.values()]
    momentum_b = [s["momentum_buffer"] for s in b.optimizer.state.values()]
    assert all(torch.equal(x, y) for x, y in zip(momentum_a, momentum_b, strict=True))


def test_resume_after_sigterm_mid_epoch_matches_an_uninterrupted_run(
    runtime_env: Any, storage_root: str, regression_data: str
) -> None:
    reference, code = run(Regression, paths.join(storage_root, "a"), regression_data)
    assert code == 0 and reference.step == 30 and reference.evaluations == [10, 20, 30]

    first, code = run(Regression, paths.join(storage_root, "b"), regression_data, preempt_at=13)
    assert code == 143 and first.step == 13 and first.exported == []
    second, code = run(Regression, paths.join(storage_root, "b"), regression_data)
    assert code == 0 and second.step == 30

    assert first.seen + second.seen == reference.seen  # no record skipped or repeated
    assert sorted(reference.seen[:40]) == list(range(40))
    assert first.evaluations + second.evaluations == [10, 20, 30]
    assert second.exported == [second.ctx.env.model_dir]
    assert_same_training(reference, second)


def test_sigterm_during_evaluation_saves_and_reruns_it_on_resume(
    runtime_env: Any, tmp_path: Any, regression_data: str
) -> None:
    reference, _ = run(Regression, str(tmp_path / "a"), regression_data)
    first, code = run(Regression, str(tmp_path / "b"), regression_data, preempt_in_eval=(20, 2))
    assert code == 143 and first.evaluations == [10]
    second, code = run(Regression, str(tmp_path / "b"), regression_data)
    assert code == 0 and second.evaluations == [20, 30]
    assert first.seen + second.seen == reference.seen
    assert_same_training(reference, second)


def test_corrupt_newest_checkpoint_falls_back_to_the_previous_step(
    runtime_env: Any, tmp_path: Any, regression_data: str, caplog: Any
) -> None:
    reference, _ = run(Regression, str(tmp_path / "a"), regression_data)
    first, code = run(Regression, str(tmp_path / "b"), regression_data, preempt_at=13)
    assert code == 143
    newest = tmp_path / "b" / "ckpt" / "step_0000000013"
    data_file = sorted(newest.glob("*.bin"))[0]
    corrupted = bytearray(data_file.read_bytes())
    corrupted[len(corrupted) // 2] ^= 0xFF
    data_file.write_bytes(bytes(corrupted))

    second, code = run(Regression, str(tmp_path / "b"), regression_data)
    assert code == 0 and second.step == 30
    assert "skipping checkpoint step 13" in caplog.text and data_file.name in caplog.text
    assert second.seen == reference.seen[10 * 4 :]  # resumed from step 10, the newest valid one
    assert_same_training(reference, second)


class ListData(Regression):
    """Batches from a plain list: no reader state, so resuming replays and skips the epoch's batches."""

    def setup(self) -> None:
        super().setup()
        self.train_data = list(self.train_data)  # one epoch's batches, the same order every epoch


def test_data_without_state_resumes_by_skipping_seen_batches(
    runtime_env: Any, tmp_path: Any, regression_data: str, caplog: pytest.LogCaptureFixture
) -> None:
    reference, _ = run(ListData, str(tmp_path / "a"), regression_data)
    first, code = run(ListData, str(tmp_path / "b"), regression_data, preempt_at=17)
    assert code == 143
    second, _ = run(ListData, str(tmp_path / "b"), regression_data)
    assert first.seen + second.seen == reference.seen
    assert "skipping 7 batches to resume" in caplog.text
    assert_same_training(reference, second)


class WorkerData(Regression):
    """A DataLoader with worker processes: the read position lives in the workers."""

    def setup(self) -> None:
        super().setup()
        reader = self.train_data.dataset
        self.train_data = DataLoader(reader, batch_size=4, collate_fn=collate, num_workers=2)


def test_dataloader_workers_resume_by_skipping_seen_batches(
    runtime_env: Any, tmp_path: Any, regression_data: str, caplog: pytest.LogCaptureFixture
) -> None:
    reference, _ = run(WorkerData, str(tmp_path / "a"), regression_data, max_epochs=2)
    first, code = run(WorkerData, str(tmp_path / "b"), regression_data, preempt_at=14, max_epochs=2)
    assert code == 143
    second, _ = run(WorkerData, str(tmp_path / "b"), regression_data, max_epochs=2)
    assert "_train_data" not in second.state()["local"]
    assert "skipping 4 batches to resume" in caplog.text
    assert first.seen + second.seen == reference.seen
    assert sorted(reference.seen[:40]) == list(range(40))


class VertexrtLoader(Regression):
    """vertexrt's DataLoader: an exact read position with worker processes."""

    def setup(self) -> None:
        super().setup()
        reader = self.train_data.dataset.dataset
        self.train_data = vertexrt.data.torch.DataLoader(
            reader, batch_size=4, collate_fn=collate, num_workers=2
        )


def test_vertexrt_dataloader_with_workers_resumes_exactly(
    runtime_env: Any, tmp_path: Any, regression_data: str, caplog: pytest.LogCaptureFixture
) -> None:
    reference, _ = run(VertexrtLoader, str(tmp_path / "a"), regression_data, max_epochs=2)
    first, code = run(VertexrtLoader, str(tmp_path / "b"), regression_data, preempt_at=14, max_epochs=2)
    assert code == 143
    second, _ = run(VertexrtLoader, str(tmp_path / "b"), regression_data, max_epochs=2)
    assert "train_data" in second.state()["local"] and "skipping" not in caplog.text
    assert first.seen + second.seen == reference.seen
    assert_same_training(reference, second)


def test_max_steps_stops_mid_epoch_evaluates_and_saves_the_last_step(
    runtime_env: Any, tmp_path: Any, regression_data: str
) -> None:
    trainer, code = run(Regression, str(tmp_path / "a"), regression_data, max_steps=7)
    assert code == 0 and trainer.step == 7 and trainer.evaluations == [7]
    assert CheckpointManager(str(tmp_path / "a" / "ckpt")).latest_step() == 7
    again, _ = run(Regression, str(tmp_path / "a"), regression_data, max_steps=7)  # a restart after the end
    assert again.seen == [] and again.evaluations == []


def test_fit_installs_the_sigterm_handler_itself_without_main(
    runtime_env: Any, tmp_path: Any, regression_data: str
) -> None:
    before = signal.getsignal(signal.SIGTERM)
    ctx = Context.create()
    ctx.checkpoints = CheckpointManager(str(tmp_path / "ckpt"), save_policy=EveryNSteps(100))
    with pytest.raises(Preempted) as stop:
        Regression(ctx, regression_data, preempt_at=4).fit()
    assert stop.value.code == 143 and ctx.checkpoints.latest_step() == 4
    assert signal.getsignal(signal.SIGTERM) is before
    ctx.close()


def test_metrics_go_to_hypertune_and_fit_returns_the_last_ones(
    runtime_env: Any, tmp_path: Any, regression_data: str
) -> None:
    ctx = Context.create()
    ctx.checkpoints = CheckpointManager(str(tmp_path / "ckpt"), save_policy=EveryNSteps(100))
    try:
        assert Regression(ctx, regression_data, max_epochs=2).fit() == {"score": 20.0}
    finally:
        ctx.close()
    reports = [json.loads(line) for line in runtime_env.read_text().splitlines()]
    assert [(r["score"], r["global_step"]) for r in reports] == [("10.0", "10"), ("20.0", "20")]


def test_state_separates_replicated_from_per_rank_parts(runtime_env: Any, regression_data: str) -> None:
    trainer = Regression(Context.create(), regression_data)
    trainer.setup()
    state = trainer.state()
    assert list(state["replicated"]) == ["model", "optimizer"]
    assert list(state["local"]) == ["_loop", "_rng", "noise", "_train_data"]
    assert state["local"]["_train_data"] is trainer.train_data.dataset


def test_fit_without_train_data_names_the_fix(runtime_env: Any) -> None:
    class Empty(Trainer):
        pass

    with pytest.raises(ConfigError, match="self.train_data"):
        Empty(Context.create()).fit()


def test_bad_arguments_are_config_errors(runtime_env: Any) -> None:
    with pytest.raises(ConfigError, match="max_epochs"):
        Trainer(Context.create(), max_epochs=0)
    with pytest.raises(ConfigError, match="eval_every"):
        Trainer(Context.create(), eval_every=0)


def test_several_replicas_without_torch_distributed_is_a_clear_error(
    vertex_env: Any, tmp_path: Any, regression_data: str
) -> None:
    vertex_env(workers=1, task=("workerpool1", 0))
    ctx = Context.create()
    ctx.checkpoints = CheckpointManager(str(tmp_path / "ckpt"))
    with pytest.raises(ConfigError, match=r"Trainer with 2 replicas needs torch.distributed"):
        Regression(ctx, regression_data).fit()
    ctx.close()


class Counting(Trainer):
    """10 list batches per epoch (a known length); evaluate() scores the step it runs at."""

    def setup(self) -> None:
        self.train_data = list(range(10))

    def train_step(self, batch: int) -> dict[str, float]:
        return {}

    def evaluate(self) -> dict[str, float]:
        return {"score": float(self.step)}

    def export(self, model_dir: str) -> None:
        pass


@pytest.mark.parametrize("eval_every", [None, 5])
def test_a_checkpoint_carries_the_metrics_of_its_own_step(
    runtime_env: Any, tmp_path: Any, eval_every: int | None
) -> None:
    ctx = Context.create()
    manager = CheckpointManager(str(tmp_path / "ckpt"), save_policy=EveryNSteps(5))
    Counting(ctx, max_epochs=2, eval_every=eval_every, checkpoints=manager, progress_bar=False).fit()
    ctx.close()
    evaluated = [10, 20] if eval_every is None else [5, 10, 15, 20]
    for step in manager.all_steps():
        metrics = manager.metadata(step)["metrics"]
        if step in evaluated:  # evaluated at this step: its checkpoint has these metrics, not the previous
            assert metrics == {"score": float(step)}, step


class SavesRecorded(CheckpointManager):
    """A real manager that records the steps it committed to write."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.saved_steps: list[int] = []

    def save(self, step: int, *args: Any, **kwargs: Any) -> bool:
        saved = super().save(step, *args, **kwargs)
        if saved:
            self.saved_steps.append(step)
        return saved


def test_sigterm_in_an_evaluation_right_after_saving_that_step_never_rewrites_it(
    runtime_env: Any, tmp_path: Any, regression_data: str
) -> None:
    reference, _ = run(Regression, str(tmp_path / "a"), regression_data)
    ctx = Context.create()
    ctx.install_preemption_handler()
    ctx.checkpoints = manager = SavesRecorded(str(tmp_path / "b" / "ckpt"), save_policy=EveryNSteps(5))
    first = Regression(ctx, regression_data, max_epochs=3, preempt_in_eval=(20, 2))
    with pytest.raises(Preempted):
        first.fit()
    ctx.close()
    assert manager.saved_steps == [5, 10, 15, 20]  # step 20 (saved before the epoch-end evaluation) once
    second, code = run(Regression, str(tmp_path / "b"), regression_data)
    assert code == 0 and first.evaluations + second.evaluations == [10, 20, 30]
    assert first.seen + second.seen == reference.seen
    assert_same_training(reference, second)


def test_several_replicas_refuse_unequalized_data_naming_the_fix() -> None:
    from vertexrt.runtime.trainer_data import check_equalized

    class Unequal(list):  # type: ignore[type-arg]
        equalized = False

    check_equalized(Unequal(range(10)), 1, "OnUnequal")  # one replica: nothing to wait for
    with pytest.raises(ConfigError, match=r"OnUnequal.train_data .* 2 replicas.*equalize='drop_remainder'"):
        check_equalized(Unequal(range(10)), 2, "OnUnequal")


class Accumulating(Regression):
    """Per-epoch accumulators assigned in setup() and updated each step; a setting from __init__."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.label = "config"  # __init__: configuration, not saved
        self.best = -1.0
        self.track("best")  # ... unless asked

    def setup(self) -> None:
        super().setup()
        self.batches_in_epoch: list[int] = []
        self.totals = {"steps": 0, "loss": 0.0}
        self.handle = object()  # not JSON-able: never saved

    def train_step(self, batch: dict[str, torch.Tensor]) -> dict[str, Any]:
        metrics = super().train_step(batch)
        self.batches_in_epoch = [*self.batches_in_epoch[-9:], self.step + 1]
        self.totals["steps"] += 1
        self.totals["loss"] += 0.5
        self.best = max(self.best, float(self.step))
        return metrics


def test_plain_attributes_assigned_after_init_survive_a_resume(
    runtime_env: Any, tmp_path: Any, regression_data: str
) -> None:
    reference, _ = run(Accumulating, str(tmp_path / "a"), regression_data)
    first, code = run(Accumulating, str(tmp_path / "b"), regression_data, preempt_at=13)
    assert code == 143
    local = first.state()["local"]["_loop"].state_dict()["attributes"]
    assert sorted(local) == ["batches_in_epoch", "best", "totals"]  # not label, handle, seen (from __init__)
    second, code = run(Accumulating, str(tmp_path / "b"), regression_data)
    assert code == 0
    assert second.totals == reference.totals == {"steps": 30, "loss": 15.0}
    assert second.batches_in_epoch == reference.batches_in_epoch and second.best == reference.best == 29.0
    assert_same_training(reference, second)


def test_resuming_off_vertex_says_so_loudly(
    runtime_env: Any, tmp_path: Any, regression_data: str, caplog: pytest.LogCaptureFixture
) -> None:
    run(Regression, str(tmp_path / "a"), regression_data, preempt_at=13)
    caplog.clear()
    caplog.set_level(logging.INFO)
    run(Regression, str(tmp_path / "a"), regression_data)
    warned = [r for r in caplog.records if r.levelno == logging.WARNING and "resuming from" in r.getMessage()]
    assert len(warned) == 1
    assert f"resuming from {tmp_path / 'a' / 'ckpt'} (step 13)" in warned[0].getMessage()
    assert "VERTEXRT_LOCAL_DIR" in warned[0].getMessage()
    said = [
        r.getMessage()
        for r in caplog.records
        if r.levelno == logging.INFO and "resuming from" in r.getMessage()
    ]
    assert said == [f"resuming from {tmp_path / 'a' / 'ckpt'} (step 13): epoch 1, batch 3"]  # the shared line


class Reseeded(Regression):
    def setup(self) -> None:
        super().setup()
        reader = vertexrt.data.open_dataset(self.data, "jsonl", seed=4, shuffle_buffer=8, prefetch=0)
        self.train_data = DataLoader(reader.as_torch(), batch_size=4, collate_fn=collate)


def test_a_reader_opened_otherwise_than_its_checkpoint_says_what_to_do_in_trainer_terms(
    runtime_env: Any, tmp_path: Any, regression_data: str
) -> None:
    run(Regression, str(tmp_path / "a"), regression_data, preempt_at=13)
    with pytest.raises(DataError) as raised:
        run(Reseeded, str(tmp_path / "a"), regression_data)
    message = str(raised.value)
    assert "seed: saved 3, now 4" in message  # what changed
    assert f"step 13 in {tmp_path / 'a' / 'ckpt'}" in message  # which checkpoint
    assert "VERTEXRT_LOCAL_DIR" in message and "AIP_CHECKPOINT_DIR" in message  # how to start fresh
    assert "load_state_dict" not in message and "storage access" not in message  # not the Trainer's terms


def test_train_and_evaluation_metrics_go_to_tensorboard(
    runtime_env: Any, monkeypatch: pytest.MonkeyPatch, tmp_path: Any, regression_data: str
) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    monkeypatch.setenv("AIP_TENSORBOARD_LOG_DIR", str(tmp_path / "tb"))
    ctx = Context.create()
    ctx.checkpoints = CheckpointManager(str(tmp_path / "ckpt"), save_policy=EveryNSteps(100))
    try:
        Regression(ctx, regression_data, max_epochs=2, progress_interval=0.0).fit()
    finally:
        ctx.close()
    events = EventAccumulator(str(tmp_path / "tb"), size_guidance={"scalars": 0, "tensors": 0})
    events.Reload()
    assert scalars(events, "eval/score") == [(10, 10.0), (20, 20.0)]
    assert [step for step, _ in scalars(events, "train/loss")] == list(range(1, 21))


def test_a_torch_trainer_writes_tensorboard_scalars_without_loading_tensorflow(tmp_path: Any) -> None:
    """torch's SummaryWriter imports TensorFlow whenever it is installed (as here): seconds and hundreds of
    MB in every replica. The Trainer's writer needs no framework, and TensorBoard reads what it wrote."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    script = textwrap.dedent(
        """
        import sys, torch, vertexrt

        class Steps(vertexrt.Trainer):
            def setup(self):
                self.model = torch.nn.Linear(2, 1)
                self.train_data = [torch.ones(4, 2)] * 5

            def train_step(self, batch):
                return {"loss": torch.tensor(self.step / 2)}  # steps done before this one

            def evaluate(self):
                return {"score": float(self.step), "count": (1e40, 1)}  # beyond float32: inf, as torch's

        ctx = vertexrt.Context.create()
        Steps(ctx, max_epochs=2, progress_bar=False, progress_interval=0.0, preflight=False).fit()
        ctx.close()
        print("TENSORFLOW", "tensorflow" in sys.modules)
        """
    )
    logs = tmp_path / "tb"
    env = dict(os.environ, VERTEXRT_LOCAL_DIR=str(tmp_path / "out"), AIP_TENSORBOARD_LOG_DIR=str(logs))
    done = run_job([sys.executable, "-c", script], cwd=tmp_path, timeout=120, env=env)
    assert done.returncode == 0, done.stdout[-3000:]
    assert "TENSORFLOW False" in done.stdout, done.stdout[-3000:]
    events = EventAccumulator(str(logs), size_guidance={"scalars": 0})
    events.Reload()
    assert sorted(events.Tags()["scalars"]) == ["eval/count", "eval/score", "train/loss"]
    assert scalars(events, "eval/score") == [(5, 5.0), (10, 10.0)]
    assert scalars(events, "eval/count") == [(5, float("inf")), (10, float("inf"))]
    assert scalars(events, "train/loss") == [(step, (step - 1) / 2) for step in range(1, 11)]


def scalars(events: Any, tag: str) -> list[tuple[int, float]]:
    """A tag's (step, value) pairs, written by torch's writer or tf.summary (the backend ``auto`` picks)."""
    if tag in events.Tags()["scalars"]:
        return [(e.step, e.value) for e in events.Scalars(tag)]
    import tensorflow as tf

    return [(e.step, float(tf.make_ndarray(e.tensor_proto))) for e in events.Tensors(tag)]


def test_fit_runs_the_preflight_checks_unless_told_not_to(
    runtime_env: Any, monkeypatch: pytest.MonkeyPatch, tmp_path: Any
) -> None:
    from vertexrt.errors import PreflightError

    monkeypatch.setenv("AIP_CHECKPOINT_DIR", "/sys/x")
    ctx = Context.create()
    with pytest.raises(PreflightError, match="AIP_CHECKPOINT_DIR=/sys/x is not writable"):
        Counting(ctx, checkpoints=CheckpointManager(str(tmp_path / "c")), progress_bar=False).fit()
    trainer = Counting(ctx, checkpoints=CheckpointManager(str(tmp_path / "c")), preflight=False)
    assert trainer.fit() == {"score": 10.0}
    ctx.close()


def test_two_replicas_train_one_model_and_average_the_evaluation(runtime_env: Any, tmp_path: Any) -> None:
    script = SCRIPTS / "trainer_two_replicas.py"
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    env = {**os.environ, "VERTEXRT_LOG_FORMAT": "text"}
    done = run_job([*torchrun, str(script), str(tmp_path)], None, 300, env, merge_stderr=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert ranks[0]["weights"] == ranks[1]["weights"]  # gradients averaged: one model, not two
    assert ranks[0]["during_fit"] == "DistributedDataParallel" and ranks[0]["exported"] == "Linear"
    assert ranks[0]["after_fit"] == ranks[1]["after_fit"] == "Linear"  # the user's module again after fit
    assert ranks[0]["saved_keys"] == ["bias", "weight"]  # the bare module's keys, as a 1-replica run saves
    expected = {"accuracy": pytest.approx((0.9 * 30 + 0.6 * 10) / 40), "loss": pytest.approx(2.0)}
    assert ranks[0]["metrics"] == ranks[1]["metrics"] == expected
    reports = [json.loads(line) for line in runtime_env.read_text().splitlines()]
    assert [float(r["accuracy"]) for r in reports if "accuracy" in r] == [
        pytest.approx(0.825)
    ]  # chief, averaged


@pytest.mark.slow
def test_tensor_parallel_dtensor_modules_are_checkpointed_through_dcp(tmp_path) -> None:
    """A module whose parameters are DTensors (here distribute_module; FSDP2 in
    tests/checkpoint/test_trainer_fsdp.py) is saved by every rank through DCP and restored in place."""
    env = dict(os.environ, VERTEXRT_LOCAL_DIR=str(tmp_path))
    command = [sys.executable, str(SCRIPTS / "trainer_dtensor.py"), str(free_port())]
    done = run_job(command, None, 300, env, merge_stderr=False)
    assert "RESTORED" in done.stdout, done.stdout + done.stderr[-3000:]
    assert "(step 2)" in done.stderr  # the second fit() resumed the first one's checkpoint


def test_per_rank_state_for_dcp_packs_free_form_values_and_a_damaged_pack_is_a_typed_error() -> None:
    """DCP unpickles values with weights_only (no numpy, no bytes): per-rank state is packed instead."""
    import io

    from vertexrt.checkpoint import rng_state
    from vertexrt.errors import CheckpointCorruptError
    from vertexrt.runtime.state import GeneratorState
    from vertexrt.runtime.trainer_sharded import Packed

    noise = np.random.default_rng(7)
    state = {"noise": GeneratorState(noise), "rng": rng_state(), "counts": {"a": [1, 2]}, "w": torch.ones(3)}
    buffer = io.BytesIO()
    torch.save(Packed(state, "state of rank 0").state_dict(), buffer)  # as DCP writes a value
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=True)
    expected, torch_draw = noise.random(3), torch.rand(2)
    target = {"noise": GeneratorState(np.random.default_rng(0)), "rng": rng_state(), "counts": None}
    target["w"] = torch.zeros(3)
    Packed(target, "state of rank 0").load_state_dict(saved)
    assert np.array_equal(target["noise"].generator.random(3), expected)
    assert torch.equal(torch.rand(2), torch_draw) and torch.equal(target["w"], torch.ones(3))
    assert target["counts"] == {"a": [1, 2]}
    for damaged in ({**saved, "blob": saved["blob"][:-8]}, {**saved, "blob": "#"}, {"tree": "{"}):
        with pytest.raises(CheckpointCorruptError, match="state of rank 0"):
            Packed(target, "state of rank 0").load_state_dict(damaged)


@pytest.mark.slow
def test_a_read_error_on_one_rank_stops_every_rank_instead_of_a_hang_or_a_silent_rollback(tmp_path) -> None:
    script = str(SCRIPTS / "restore_error_worker.py")
    argv = lambda rank, port: [str(rank), "2", str(port), str(tmp_path)]  # noqa: E731
    reports = []
    for code, out, err in run_ranks(script, 2, argv, timeout=300):
        assert code == 0, err[-3000:]
        reports.append(json.loads(out.strip().splitlines()[-1]))
    chief, other = reports
    assert other["type"] == "CheckpointError" and "Input/output error" in other["message"], reports
    assert chief["type"] == "CheckpointError" and "another rank" in chief["message"], reports

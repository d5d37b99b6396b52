"""Trainer.fit(): resume after a real SIGTERM gives the uninterrupted result, on local disk and gs://."""

from __future__ import annotations

import json
import os
import random
import signal
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

import vertexrt.data
import vertexrt.data.torch
from vertexrt import paths
from vertexrt.checkpoint import CheckpointManager, EveryNSteps
from vertexrt.errors import ConfigError
from vertexrt.runtime import Context, Preempted, Trainer


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

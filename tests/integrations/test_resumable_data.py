"""Training data under a real Lightning fit, preempted (a save, then the process stops) mid-epoch and on an
epoch's last batch: the resumed fit trains on every record of every epoch exactly once, in the same order as
an uninterrupted fit, and runs every step."""

from __future__ import annotations

import json
import logging
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("lightning", reason="the lightning extra is not installed")
pytest.importorskip("torchdata", reason="torchdata (the torch extra) is not installed")
import lightning.pytorch as pl  # noqa: E402
import torch  # noqa: E402

import vertexrt  # noqa: E402
from vertexrt.data import open_dataset, resumable_loader  # noqa: E402
from vertexrt.data.resume_check import resume_problem  # noqa: E402
from vertexrt.data.torch import DataLoader as StreamingLoader  # noqa: E402
from vertexrt.runtime.context import Context  # noqa: E402

EPOCHS = 3


class Recorder(pl.LightningModule):
    """Records ``(epoch, ids of the batch)`` for every training step; learns nothing."""

    def __init__(self, key: Callable[[Any], list[int]]) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(1, 1)
        self.key = key
        self.seen: list[tuple[int, list[int]]] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.seen.append((self.current_epoch, self.key(batch)))
        return self.layer(torch.ones(1, 1)).sum() * 0

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.0)


class Preempt(pl.Callback):
    """Saves a checkpoint at the end of step ``step`` and stops the process, as a preemption save does."""

    def __init__(self, step: int, path: Path) -> None:
        self.step, self.path = step, path

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        if trainer.global_step == self.step:
            trainer.save_checkpoint(self.path)
            raise SystemExit(143)


def fit(
    loader: Any, key: Callable[[Any], list[int]], ckpt: Path, stop: int | None = None
) -> tuple[Recorder, int]:
    model = Recorder(key)
    trainer = pl.Trainer(
        max_epochs=EPOCHS,
        accelerator="cpu",
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        num_sanity_val_steps=0,
        callbacks=[] if stop is None else [Preempt(stop, ckpt)],
    )
    try:
        trainer.fit(model, loader, ckpt_path=ckpt if stop is None and ckpt.exists() else None)
    except SystemExit as stopped:
        assert stopped.code == 143
    return model, trainer.global_step


def preempted(make: Callable[[], Any], key: Callable[[Any], list[int]], tmp: Path, stop: int) -> list[Any]:
    ckpt = tmp / f"stop-{stop}.ckpt"
    first, steps = fit(make(), key, ckpt, stop)
    assert steps == stop and ckpt.exists()
    second, steps = fit(make(), key, ckpt)
    return [first.seen + second.seen, steps]


def tensor_ids(batch: Any) -> list[int]:
    return [int(i) for i in batch[0].flatten()]


def record_ids(batch: Any) -> list[int]:
    return [int(i) for i in batch["id"]]


@pytest.mark.parametrize("workers", [0, 2])
def test_resumable_loader_resumes_mid_epoch_and_after_the_last_batch_of_an_epoch(
    tmp_path: Path, workers: int
) -> None:
    dataset = torch.utils.data.TensorDataset(torch.arange(64))

    def make() -> Any:
        return resumable_loader(dataset, batch_size=8, seed=3, rank=0, world_size=1, num_workers=workers)

    reference, steps = fit(make(), tensor_ids, tmp_path / "none.ckpt")
    assert steps == 24 and [e for e, _ in reference.seen] == [0] * 8 + [1] * 8 + [2] * 8
    orders = [[i for e, ids in reference.seen if e == epoch for i in ids] for epoch in range(EPOCHS)]
    assert all(sorted(order) == list(range(64)) for order in orders) and orders[0] != orders[1]
    for stop in (12, 16):  # mid-epoch 1; the last batch of epoch 1
        seen, steps = preempted(make, tensor_ids, tmp_path, stop)
        assert steps == 24 and seen == reference.seen, f"preempted at step {stop}"


@pytest.mark.parametrize("workers", [0, 2, "persistent"])
def test_vertexrt_dataloader_under_lightning_loses_no_batch_on_resume(tmp_path: Path, workers: Any) -> None:
    for part, size in enumerate((23, 41, 30)):  # 94 records; equalized to 92, 23 batches of 4
        lines = (json.dumps({"id": 100 * part + i}) for i in range(size))
        (tmp_path / f"part-{part}.jsonl").write_text("\n".join(lines) + "\n")

    def make() -> StreamingLoader:
        ds = open_dataset(f"{tmp_path}/part-*.jsonl", seed=5, rank=0, world_size=1, equalize="drop_remainder",
                          batch_size=4)  # fmt: skip
        persistent = workers == "persistent"
        return StreamingLoader(
            ds, batch_size=4, num_workers=2 if persistent else workers, persistent_workers=persistent
        )

    per_epoch = len(make())
    reference, steps = fit(make(), record_ids, tmp_path / "none.ckpt")
    assert steps == EPOCHS * per_epoch
    for stop in (per_epoch + 3, 2 * per_epoch):  # mid-epoch 1; the last batch of epoch 1
        seen, steps = preempted(make, record_ids, tmp_path, stop)
        assert steps == EPOCHS * per_epoch, f"preempted at step {stop}: {steps} steps"
        for epoch in range(EPOCHS):
            got = Counter(i for e, ids in seen if e == epoch for i in ids)
            want = Counter(i for e, ids in reference.seen if e == epoch for i in ids)
            assert got == want and max(got.values()) == 1, f"epoch {epoch}, preempted at step {stop}"


def test_loaders_that_cannot_resume_exactly_are_named_with_the_fix(
    caplog: pytest.LogCaptureFixture, tmp_path: Path
) -> None:
    (tmp_path / "a.jsonl").write_text("".join(json.dumps({"id": i}) + "\n" for i in range(5)))
    from torchdata.stateful_dataloader import StatefulDataLoader

    from vertexrt.integrations.lightning import VertexCallback

    data = torch.utils.data.TensorDataset(torch.arange(8))
    shuffled = torch.utils.data.DataLoader(data, batch_size=2, shuffle=True)
    assert "RandomSampler" in (resume_problem(shuffled) or "")
    assert "resumable_loader" in (resume_problem(shuffled, restores_state_only=True) or "")
    ordered = torch.utils.data.DataLoader(data, batch_size=2)
    assert resume_problem(ordered) is None  # vertexrt.Trainer replays the order and skips what was seen
    assert "no state_dict" in (resume_problem(ordered, restores_state_only=True) or "")
    stateful = StatefulDataLoader(data, batch_size=2, shuffle=True)
    assert "empty next epoch" in (resume_problem(stateful, restores_state_only=True) or "")
    assert (
        resume_problem(resumable_loader(data, batch_size=2, rank=0, world_size=1), restores_state_only=True)
        is None
    )

    reader = open_dataset(str(tmp_path / "*.jsonl"), equalize="off", rank=0, world_size=1)
    assert "no len()" in (resume_problem(reader, restores_state_only=True) or "")
    assert "no len()" in (
        resume_problem(StreamingLoader(reader, batch_size=2), restores_state_only=True) or ""
    )
    assert resume_problem(StreamingLoader(reader, batch_size=2)) is None  # vertexrt.Trainer: no read-ahead

    class Trainer:  # what the callback reads at on_train_start
        train_dataloader = shuffled

    with caplog.at_level(logging.WARNING, logger="vertexrt.data.resume_check"):
        VertexCallback.on_train_start(VertexCallback.__new__(VertexCallback), Trainer(), None)  # type: ignore[arg-type]
    assert "VertexCallback: the training loader (torch.utils.data.dataloader.DataLoader)" in caplog.text
    assert "resumable_loader(dataset" in caplog.text


def test_resumable_loader_state_is_json_and_rejects_a_foreign_state() -> None:
    from vertexrt.errors import ConfigError

    loader = resumable_loader(
        torch.utils.data.TensorDataset(torch.arange(10)), batch_size=2, rank=1, world_size=2
    )
    it = iter(loader)
    next(it)
    state = json.loads(json.dumps(loader.state_dict()))
    assert state["epoch"] == 0
    with pytest.raises(ConfigError, match="not a state this loader saved"):
        loader.load_state_dict({"yielded": 3})


def test_trainer_warns_about_a_shuffled_plain_dataloader(
    caplog: pytest.LogCaptureFixture, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    class Shuffled(vertexrt.Trainer):
        def setup(self) -> None:
            self.model = torch.nn.Linear(1, 1)
            data = torch.utils.data.TensorDataset(torch.arange(4.0).unsqueeze(1))
            self.train_data = torch.utils.data.DataLoader(data, batch_size=2, shuffle=True)

        def train_step(self, batch: Any) -> dict[str, float]:
            return {}

        def export(self, model_dir: str) -> None:
            pass

    for name in ("AIP_CHECKPOINT_DIR", "AIP_MODEL_DIR", "AIP_TENSORBOARD_LOG_DIR"):
        monkeypatch.setenv(name, str(tmp_path / name))
    ctx = Context.create()
    try:
        with caplog.at_level(logging.WARNING, logger="vertexrt.data.resume_check"):
            Shuffled(ctx, max_epochs=1, tensorboard=False, preflight=False).fit()
    finally:
        ctx.close()
    assert (
        "Shuffled.train_data: the training loader (torch.utils.data.dataloader.DataLoader) shuffles"
        in caplog.text
    )


class Recording(vertexrt.Trainer):
    """Trains on ``resumable_loader`` batches, recording ``(epoch, ids)`` into ``seen``."""

    def __init__(self, seen: list[tuple[int, list[int]]], **options: Any) -> None:
        super().__init__(Context.create(), tensorboard=False, preflight=False, **options)
        self.seen = seen

    def setup(self) -> None:
        self.model = torch.nn.Linear(1, 1)
        dataset = torch.utils.data.TensorDataset(torch.arange(64))
        self.train_data = resumable_loader(dataset, batch_size=8, seed=3, rank=0, world_size=1)

    def train_step(self, batch: Any) -> dict[str, float]:
        self.seen.append((self.epoch, tensor_ids(batch)))
        return {}

    def export(self, model_dir: str) -> None:
        pass


@pytest.mark.parametrize("stop", [12, 16])  # mid-epoch 1; the last batch of epoch 1
def test_vertexrt_trainer_resumes_a_resumable_loader_exactly(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, stop: int
) -> None:
    for name in ("AIP_MODEL_DIR", "AIP_TENSORBOARD_LOG_DIR"):
        monkeypatch.setenv(name, str(tmp_path / name))
    monkeypatch.setenv("AIP_CHECKPOINT_DIR", str(tmp_path / "reference"))
    reference: list[tuple[int, list[int]]] = []
    Recording(reference, max_epochs=EPOCHS).fit()
    assert len(reference) == 24 and [e for e, _ in reference] == [0] * 8 + [1] * 8 + [2] * 8
    monkeypatch.setenv("AIP_CHECKPOINT_DIR", str(tmp_path / "stopped"))
    seen: list[tuple[int, list[int]]] = []
    first = Recording(seen, max_epochs=EPOCHS, max_steps=stop)  # its last step is saved, as a preemption's
    first.fit()
    first.ctx.close()
    second = Recording(seen, max_epochs=EPOCHS)
    second.fit()
    second.ctx.close()
    assert second.step == 24 and seen == reference


def test_a_state_taken_after_an_epoch_ended_names_the_next_epoch_once() -> None:
    loader = resumable_loader(
        torch.utils.data.TensorDataset(torch.arange(8)), batch_size=2, rank=0, world_size=1
    )
    loader.sampler.set_epoch(4)
    assert len(list(loader)) == 4
    assert loader.state_dict() == {"epoch": 5, "loader": {}}
    loader.sampler.set_epoch(5)  # the loop moved on before saving
    assert loader.state_dict() == {"epoch": 5, "loader": {}}
    again = resumable_loader(
        torch.utils.data.TensorDataset(torch.arange(8)), batch_size=2, rank=0, world_size=1
    )
    again.load_state_dict(loader.state_dict())
    assert again.sampler.epoch == 5 and len(list(again)) == 4

"""A Lightning classifier on Vertex AI: DDP over the job's replicas, preemption-safe, resumable mid-epoch.

The vertexrt lines: ``VertexCallback(...)``, ``plugins=vertex.plugins()`` + ``callbacks=[vertex]``,
``ckpt_path=vertex.ckpt_path()``, and ``vertexrt.data.resumable_loader(...)`` for the training data (a
resume continues at the next unseen batch of the epoch Lightning restores). Try it as a preempted
2-replica job:

    vertexrt local-run --workers 2 --preempt-after 20 -- python examples/lightning_classifier.py
"""

from __future__ import annotations

import argparse
import os
import time
from typing import Any

import lightning.pytorch as pl
import torch

from vertexrt import paths
from vertexrt.data import resumable_loader
from vertexrt.distributed import cluster
from vertexrt.env import environment
from vertexrt.integrations.lightning import VertexCallback
from vertexrt.preemption.signals import preemption_signal

FEATURES, CLASSES, SAMPLES, BATCH = 16, 4, 512, 16


def make_data(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(SAMPLES, FEATURES, generator=g)
    y = (x @ torch.randn(FEATURES, CLASSES, generator=g)).argmax(dim=1)
    return x, y


class Classifier(pl.LightningModule):
    def __init__(self, hold_at_step: int = -1) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(FEATURES, 32), torch.nn.ReLU(), torch.nn.Linear(32, CLASSES)
        )
        self.hold_at_step = hold_at_step

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if self.global_step == self.hold_at_step:  # demo: wait here for the preemption notice
            deadline = time.monotonic() + 120
            while not preemption_signal().requested and time.monotonic() < deadline:
                time.sleep(0.05)
        x, y = batch
        return torch.nn.functional.cross_entropy(self.net(x), y)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", torch.nn.functional.cross_entropy(self.net(x), y), sync_dist=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=1e-2)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--hold-at-step", type=int, default=-1, help="first attempt waits there for SIGTERM")
    args = parser.parse_args()

    c, env = cluster(), environment()
    vertex = VertexCallback(monitor="val_loss")
    resume = vertex.ckpt_path()
    print(
        f"rank {c.rank}/{c.world_size}: {'resuming from ' + resume if resume else 'fresh start'}", flush=True
    )
    torch.manual_seed(0)
    model = Classifier(args.hold_at_step if resume is None else -1)
    x, y = make_data()
    val = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x[:64], y[:64]), batch_size=32)
    trainer = pl.Trainer(
        max_epochs=args.epochs,
        accelerator="cpu",
        devices=1,
        num_nodes=c.num_nodes,
        strategy="ddp" if c.world_size > 1 else "auto",
        plugins=vertex.plugins(),
        callbacks=[vertex],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=env.checkpoint_dir,
    )
    # this rank's share, reshuffled each epoch (Lightning sets it); Lightning saves the position with each
    # checkpoint and the resume continues at the next unseen batch
    train = resumable_loader(torch.utils.data.TensorDataset(x, y), batch_size=BATCH, shuffle=True, seed=0)
    trainer.fit(model, train, val, ckpt_path=resume)
    if trainer.is_global_zero:
        with paths.open(paths.join(env.model_dir, "model.pt"), "wb") as f:
            torch.save(model.state_dict(), f)
        print(f"done: {trainer.global_step} steps, model in {env.model_dir}", flush=True)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()

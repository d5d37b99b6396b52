"""A ``pytorch_lightning.Trainer`` (the standalone package) with vertexrt's plugins and callback:
``pl_standalone_job.py SIGTERM_AT``; 6 steps, SIGTERM to itself after step SIGTERM_AT (0: never), resumes
from the newest checkpoint; prints ``RESULT {...}`` at the end."""

import json
import os
import signal
import sys

import pytorch_lightning as pl
import torch

from vertexrt.integrations.lightning import VertexCallback

sigterm_at = int(sys.argv[1])


class Tiny(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layer = torch.nn.Linear(2, 1)

    def training_step(self, batch: list[torch.Tensor], index: int) -> torch.Tensor:
        return (self.layer(batch[0]) - 1).pow(2).mean()

    def on_train_batch_end(self, *args: object) -> None:
        if self.trainer.global_step == sigterm_at:
            os.kill(os.getpid(), signal.SIGTERM)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.linspace(-1, 1, 24).view(12, 2)), 4)
vertex = VertexCallback()
quiet = {
    "logger": False,
    "enable_checkpointing": False,
    "enable_progress_bar": False,
    "enable_model_summary": False,
}
trainer = pl.Trainer(max_epochs=2, plugins=vertex.plugins(), callbacks=[vertex], **quiet)
resumed_from = vertex.ckpt_path()
model = Tiny()
trainer.fit(model, data, ckpt_path=resumed_from)
weights = [p.detach().tolist() for p in model.parameters()]
print("RESULT " + json.dumps({"resumed_from": resumed_from, "step": trainer.global_step, "weights": weights}))

"""Two replicas (under torchrun) train one model with the Trainer and average the evaluation; each writes
what it saw to ``<out>/rank<r>.json``: ``trainer_two_replicas.py OUT``."""

import json
import sys

import torch

import vertexrt
from vertexrt.checkpoint import CheckpointManager


class Bare(vertexrt.Trainer):
    def setup(self):
        torch.manual_seed(self.ctx.rank)  # different initial weights on each rank
        self.model = torch.nn.Linear(2, 1)  # a bare module, as a newcomer writes it
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.05)
        self.train_data = [torch.full((4, 2), float(self.ctx.rank + i)) for i in range(5)]  # its own shard

    def train_step(self, x):
        self.during_fit = type(self.model).__name__
        loss = (self.model(x) - 1.0).pow(2).mean()
        self.optimizer.zero_grad()
        loss.backward()
        self.optimizer.step()
        return {"loss": loss.detach()}

    def evaluate(self):
        for _ in self.interruptible(range(2)):
            pass
        rank = self.ctx.rank
        return {"accuracy": ((0.9, 30), (0.6, 10))[rank], "loss": (1.0, 3.0)[rank]}

    def export(self, model_dir):
        self.exported = type(self.model).__name__


@vertexrt.main(framework="torch")
def train(ctx):
    manager = CheckpointManager(sys.argv[1] + "/ckpt", rank=ctx.rank, world_size=ctx.world_size)
    trainer = Bare(ctx, checkpoints=manager, progress_bar=False, tensorboard=False)
    metrics = trainer.fit()
    out = {
        "metrics": metrics,
        "weights": trainer.model.weight.tolist(),
        "during_fit": trainer.during_fit,
        "after_fit": type(trainer.model).__name__,
        "saved_keys": sorted(trainer.state()["replicated"]["model"].state_dict()),
        "exported": getattr(trainer, "exported", None),
    }
    with open(f"{sys.argv[1]}/rank{ctx.rank}.json", "w") as f:
        json.dump(out, f)


train([])

"""A Trainer whose module's parameters are DTensors (one gloo rank): fit, then fit again from the checkpoint
(under ``VERTEXRT_LOCAL_DIR``); prints ``RESTORED``: ``trainer_dtensor.py PORT``."""

import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, distribute_module, distribute_tensor

import vertexrt

dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{sys.argv[1]}", rank=0, world_size=1)
mesh = init_device_mesh("cpu", (1,))


class Parallel(vertexrt.Trainer):
    def setup(self):
        torch.manual_seed(0)
        self.model = distribute_module(torch.nn.Linear(2, 2), mesh)
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.5)
        self.train_data = [torch.ones(1, 2)] * 2

    def train_step(self, batch):
        self.optimizer.zero_grad()
        self.model(distribute_tensor(batch, mesh, [Replicate()])).sum().backward()
        self.optimizer.step()
        return {}


first = Parallel(vertexrt.Context.create(), max_steps=2, preflight=False, tensorboard=False)
first.fit()
again = Parallel(vertexrt.Context.create(), max_steps=2, preflight=False, tensorboard=False)
again.fit()  # restores step 2: nothing left to train
trained = first.model.weight.full_tensor()
assert again.step == 2 and torch.equal(again.model.weight.full_tensor(), trained)
torch.manual_seed(0)
assert not torch.equal(trained, torch.nn.Linear(2, 2).weight)  # it trained before the save
dist.destroy_process_group()
print("RESTORED")

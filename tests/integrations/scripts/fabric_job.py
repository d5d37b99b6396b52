"""A 2-replica Fabric job through vertexrt: ``fabric_job.py CHECKPOINT_DIR STEPS``; resumes from the newest
checkpoint, trains STEPS steps, saves, prints the final weights from rank 0."""

import json
import sys

import torch
from lightning.fabric import Fabric

from vertexrt.integrations.lightning import VertexCheckpointIO, VertexEnvironment

directory, steps = sys.argv[1], int(sys.argv[2])
io = VertexCheckpointIO(directory)
fabric = Fabric(accelerator="cpu", devices=1, num_nodes=2, strategy="ddp", plugins=[VertexEnvironment(), io])
fabric.launch()
torch.manual_seed(0)
model = torch.nn.Linear(4, 2)
optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
model, optimizer = fabric.setup(model, optimizer)
state = {"model": model, "optimizer": optimizer, "step": 0}
latest = io.latest_path()
if latest is not None:
    fabric.load(latest, state)
for _ in range(steps):
    generator = torch.Generator().manual_seed(state["step"] * 2 + fabric.global_rank)
    loss = model(torch.randn(8, 4, generator=generator)).pow(2).mean()
    optimizer.zero_grad()
    fabric.backward(loss)
    optimizer.step()
    state["step"] += 1
fabric.save(io.path_for(state["step"]), state)
io.wait()
if fabric.global_rank == 0:
    weights = [p.detach().flatten().tolist() for p in model.parameters()]
    print("RESULT " + json.dumps({"resumed_from": latest, "step": state["step"], "weights": weights}))

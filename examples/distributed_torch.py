"""Data-parallel PyTorch training on Vertex AI, the same code locally.

On Vertex each replica runs this script once; ``init_torch()`` reads the cluster (CLUSTER_SPEC, MASTER_*,
torchrun) and joins the process group (nccl on GPUs, gloo on CPU). Locally:

    vertexrt local-run --workers 2 -- python examples/distributed_torch.py
    vertexrt local-run --workers 2 --processes-per-node 2 -- python examples/distributed_torch.py

With several GPUs per VM, start one process per GPU from the script: ``spawn(main, nprocs="gpu")``.
"""

import torch

from vertexrt.distributed import init_torch


def main() -> None:
    handle = init_torch()
    torch.manual_seed(0)  # same initial weights everywhere (DDP also broadcasts rank 0's)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 1).to(handle.device))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    true_weights = torch.tensor([[1.0, -2.0, 3.0, 0.5]])
    generator = torch.Generator().manual_seed(handle.rank)  # each rank its own shard of the data
    for step in range(50):
        x = torch.rand(32, 4, generator=generator)
        loss = torch.nn.functional.mse_loss(
            model(x.to(handle.device)), (x @ true_weights.T).to(handle.device)
        )
        optimizer.zero_grad()
        loss.backward()  # gradients are averaged across all ranks here
        optimizer.step()
        if handle.rank == 0 and step % 10 == 0:
            print(f"step {step}: loss {loss.item():.4f} on {handle.world_size} processes", flush=True)
    if handle.rank == 0:
        print("weights:", [round(w, 2) for w in model.module.weight.detach().cpu().ravel().tolist()])
    handle.shutdown()


if __name__ == "__main__":
    main()

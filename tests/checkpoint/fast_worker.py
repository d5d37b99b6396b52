"""One rank of the fast-tier recovery tests: a small data-parallel run with a durable tier every 40 steps and
a fast tier every 5, each rank with its own local directory and its own reader position and RNG stream.

Usage: python fast_worker.py RANK WORLD PORT DURABLE LOCAL_ROOT TOTAL DIE_AT TERM_AT
Rank 1 SIGKILLs itself at step DIE_AT (-1: never), once every rank's fast step before it is complete; or
SIGTERMs itself at step TERM_AT (-1: never): every rank then makes its emergency save and exits 143.
Prints one JSON line: the step it resumed from and its final weights (or the step it stopped at).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import time

import torch
import torch.distributed as dist
from rank_exit import exit_after

from vertexrt.checkpoint import CheckpointManager, EveryNSteps, FastTier, rng_state

VICTIM = 1


class Reader:
    """A data reader whose exact position is part of the state (per rank: its own shard of the data)."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.position = 0

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        gen = torch.Generator().manual_seed(1000 * self.rank + self.position)
        self.position += 1
        x = torch.randn(8, 4, generator=gen)
        return x, x.sum(dim=1, keepdim=True)

    def state_dict(self) -> dict[str, int]:
        return {"position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.position = int(state["position"])


def main(
    rank: int, world: int, port: int, durable: str, local_root: str, total: int, die_at: int, term_at: int
) -> None:
    logging.basicConfig(level=logging.INFO, format=f"%(relativeCreated)d rank {rank}: %(name)s: %(message)s")
    os.environ["VERTEXRT_LOCAL_CHECKPOINT_DIR"] = os.path.join(local_root, f"replica{rank}")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    torch.manual_seed(rank)  # each rank its own noise: its RNG state must come back as its own
    model = torch.nn.Linear(4, 1)
    with torch.no_grad():
        model.weight.fill_(0.1)
        model.bias.zero_()
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    reader = Reader(rank)
    state = {"model": model, "opt": opt, "reader": reader, "rng": rng_state(), "step": -1}
    mgr = CheckpointManager(
        durable,
        save_policy=EveryNSteps(40),
        fast=FastTier(every=EveryNSteps(5), peers=1),
        save_on_preemption=term_at >= 0,
    )
    restored = mgr.restore(target=state)
    start = restored["step"] + 1 if restored else 0
    for step in range(start, total):
        x, y = reader.next_batch()
        noise = 0.01 * torch.randn(1)
        loss = ((model(x) - y) ** 2).mean() + noise.squeeze() * model.bias.sum()
        opt.zero_grad()
        loss.backward()
        for p in model.parameters():
            dist.all_reduce(p.grad)
            p.grad /= world
        opt.step()
        state["step"] = step
        mgr.save(step, state, shard=rank)
        if die_at >= 0 and step == die_at - 1:
            mgr.wait()  # every rank's fast steps so far (and the copies) are complete ...
            dist.barrier()  # ... on every rank
        if rank == VICTIM and step == die_at:
            os.kill(os.getpid(), signal.SIGKILL)
        if term_at >= 0:
            if rank == VICTIM and step == term_at:
                os.kill(os.getpid(), signal.SIGTERM)
            stop = mgr.preemption_requested()
            while step == total - 1 and not stop:  # the ranks agree on the notice before the run ends
                time.sleep(0.01)
                stop = mgr.preemption_requested()
            if stop:
                durable_saved = mgr.save(step, state, force=True, shard=rank)
                mgr.close()
                print(json.dumps({"stopped": step, "durable": durable_saved}), flush=True)
                sys.exit(143)
    mgr.close()
    weights = [p.detach().tolist() for p in model.parameters()]
    print(json.dumps({"resumed": mgr.restored_step, "weights": weights, "position": reader.position}))
    dist.destroy_process_group()


if __name__ == "__main__":
    a = sys.argv[1:]
    exit_after(lambda: main(int(a[0]), int(a[1]), int(a[2]), a[3], a[4], int(a[5]), int(a[6]), int(a[7])))

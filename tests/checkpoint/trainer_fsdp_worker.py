"""One rank of the Trainer + FSDP2 tests.

Usage: python trainer_fsdp_worker.py RANK WORLD PORT OUT TAG:DIR:MAX_STEPS[:FAIL@R|:MODEL] [...]

For each TAG:DIR:MAX_STEPS in turn (one process group, a fresh Trainer each), a ``vertexrt.Trainer`` whose
model is ``fully_shard``-ed over WORLD gloo ranks (Adam, per-rank data with a read position, per-rank random
noise) fits to MAX_STEPS with its checkpoints in OUT/DIR, restoring the newest one first. Afterwards rank 0
writes OUT/TAG.pt: the full (unsharded) model + optimizer state, and every rank writes OUT/TAG.rank<R>.json:
the batches it trained on, its step and a torch random draw. Prints ``OK`` on success.

``FAIL@R`` makes one read fail with an OSError on rank R only (``metadata``: the checkpoint manager's
manifest read, before DCP; ``files``: the data files' check inside DCP's restore; ``damaged``: the newest
step's manifest read, as a CheckpointCorruptError); the process group then
times out after 30 s instead of 30 min, and every rank writes the error its ``fit()`` raised to
OUT/TAG.rank<R>.error.
``MODEL`` (``partial_fsdp``, ``partial_tp``) trains a model with a plain LayerNorm beside DTensor layers
(FSDP2 on the Linears only, or tensor parallel Linears) and writes the error the same way.
"""

from __future__ import annotations

import datetime
import json
import os
import sys
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from rank_exit import exit_after
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

import vertexrt
from vertexrt.checkpoint import CheckpointManager, EveryNSteps


class Batches:
    """Four batches per epoch, different on every rank, with a read position."""

    def __init__(self, rank: int) -> None:
        self.rank, self.pos, self.epoch = rank, 0, 0

    def __len__(self) -> int:
        return 4

    def set_epoch(self, epoch: int) -> None:
        self.epoch, self.pos = epoch, 0

    def __iter__(self) -> Iterator[tuple[int, torch.Tensor]]:
        while self.pos < 4:
            seed = 1000 * self.epoch + 10 * self.pos + self.rank
            self.pos += 1
            yield seed, torch.randn(4, 16, generator=torch.Generator().manual_seed(seed))

    def state_dict(self) -> dict[str, int]:
        return {"pos": self.pos, "epoch": self.epoch}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.pos, self.epoch = state["pos"], state["epoch"]


class Sharded(vertexrt.Trainer):
    def setup(self) -> None:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        torch.manual_seed(0)
        self.model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 8))
        mesh = init_device_mesh("cpu", (self.ctx.world_size,))
        for layer in (self.model[0], self.model[2]):
            fully_shard(layer, mesh=mesh)  # the top module stays plain: the Trainer must still see DTensors
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=0.01)
        self.train_data = Batches(self.ctx.rank)
        self.seen: list[int] = []  # a per-rank attribute
        torch.manual_seed(100 + self.ctx.rank)  # per-rank random noise

    def train_step(self, batch: tuple[int, torch.Tensor]) -> dict[str, Any]:
        seed, x = batch
        self.seen.append(seed)
        noise = 0.01 * torch.randn(4, 16)
        loss = (self.model(x + noise) - 1.0).pow(2).mean()
        self.optimizer.zero_grad()
        loss.backward()
        self.optimizer.step()
        return {"loss": loss.detach()}


class PartialFSDP(Sharded):
    """``fully_shard`` on the Linears only: the LayerNorm's parameters stay plain tensors."""

    def setup(self) -> None:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        super().setup()
        self.model = torch.nn.Sequential(
            torch.nn.Linear(16, 32), torch.nn.LayerNorm(32), torch.nn.Linear(32, 8)
        )
        mesh = init_device_mesh("cpu", (self.ctx.world_size,))
        for layer in (self.model[0], self.model[2]):
            fully_shard(layer, mesh=mesh)
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=0.01)


class PartialTP(Sharded):
    """Tensor parallel Linears (``parallelize_module``), a LayerNorm left out of the plan."""

    def setup(self) -> None:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        super().setup()
        self.model = torch.nn.Sequential(
            torch.nn.LayerNorm(16), torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 8)
        )
        mesh = init_device_mesh("cpu", (self.ctx.world_size,))
        parallelize_module(self.model, mesh, {"1": ColwiseParallel(), "3": RowwiseParallel()})
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=0.01)


MODELS: dict[str, type[Sharded]] = {"partial_fsdp": PartialFSDP, "partial_tp": PartialTP}


def fit(
    ctx: vertexrt.Context, root: str, out: str, max_steps: int, tag: str, model: type[Sharded] = Sharded
) -> None:
    ctx.checkpoints = CheckpointManager(root, save_policy=EveryNSteps(1000), async_save=False)
    trainer = model(
        ctx, max_epochs=9, max_steps=max_steps, progress_bar=False, tensorboard=False, preflight=False
    )
    trainer.fit()
    ctx.checkpoints.close()
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    model_sd, optim_sd = get_state_dict(trainer.model, trainer.optimizer, options=options)
    if ctx.rank == 0:
        torch.save({"model": model_sd, "optim": optim_sd}, os.path.join(out, f"{tag}.pt"))
    mine = {"seen": trainer.seen, "step": trainer.step, "draw": torch.randn(3).tolist()}
    with open(os.path.join(out, f"{tag}.rank{ctx.rank}.json"), "w") as f:
        json.dump(mine, f)
    dist.barrier()


def inject(failure: str, rank: int) -> None:
    """Make the read named by ``failure`` (``metadata``, ``files`` or ``damaged``) raise on this rank."""
    from vertexrt.checkpoint import restoring
    from vertexrt.errors import CheckpointCorruptError

    def broken(*args: Any) -> Any:
        raise OSError(f"transient: 503 reading the {failure} on rank {rank}")

    def damaged(self: CheckpointManager, step: int) -> dict[str, Any]:
        if step == max(self.all_steps()):
            raise CheckpointCorruptError(f"manifest of step {step} is damaged on rank {rank}")
        return metadata(self, step)

    metadata = CheckpointManager.metadata
    if failure == "damaged":
        CheckpointManager.metadata = damaged  # type: ignore[method-assign]
    elif failure == "metadata":
        CheckpointManager.metadata = broken  # type: ignore[method-assign]
    else:
        restoring.check_files = broken


def failing_fit(ctx: vertexrt.Context, root: str, out: str, max_steps: int, tag: str, fail: str) -> None:
    """``fit`` with ``fail`` (``WHAT@RANK`` or a model name); the error it raised is written to a file."""
    what, _, where = fail.partition("@")
    if where and ctx.rank == int(where):
        inject(what, ctx.rank)
    try:
        fit(ctx, root, out, max_steps, tag, MODELS.get(fail, Sharded))
        error = "none"
    except Exception as exc:
        error = f"{type(exc).__name__}: {exc}"
    with open(os.path.join(out, f"{tag}.rank{ctx.rank}.error"), "w") as f:
        f.write(error)


def main(rank: int, world: int, port: int, out: str, plan: list[str]) -> None:
    os.environ.update(
        VERTEXRT_LOCAL_DIR=out,
        RANK=str(rank),
        WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    injected = any(run.count(":") == 3 for run in plan)  # a hang fails in 30 s, not the default 30 min
    timeout = {"timeout": datetime.timedelta(seconds=30)} if injected else {}
    init = f"tcp://127.0.0.1:{port}"
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world, **timeout)
    for run in plan:
        tag, directory, max_steps, *fail = run.split(":")
        args = (vertexrt.Context.create(), os.path.join(out, directory), out, int(max_steps), tag)
        if fail:
            failing_fit(*args, fail[0])
        else:
            fit(*args)
    dist.destroy_process_group()
    print("OK", flush=True)
    # Skip interpreter teardown: torch's C++ state of a fit that raised at setup (FSDP hooks, DTensor meshes)
    # sometimes aborts there ("terminate called without an active exception") after the work is checked.
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    rank, world, port, out = sys.argv[1:5]
    exit_after(lambda: main(int(rank), int(world), int(port), out, sys.argv[5:]))

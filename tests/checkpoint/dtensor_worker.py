"""One rank of the sharded (FSDP2 / DTensor) checkpoint tests.

Usage: python dtensor_worker.py MODE RANK WORLD PORT ROOT OUT [EXPECTED_STEP]

- ``save``: FSDP2 over WORLD gloo ranks, two Adam steps, saves steps 1 and 2; rank 0 writes the full
  (unsharded) model + optimizer state of each step to OUT/ref_<step>.pt.
- ``restore``: a fresh model (FSDP2 over WORLD ranks, or a plain module without a process group when WORLD
  is 1) restores the newest valid step, which must be EXPECTED_STEP and equal OUT/ref_<step>.pt bit for bit.
- ``nogroup``: DTensor state whose process group is gone: restore must raise a CheckpointError.
- ``dtypes``: bf16, fp8, complex (a lazily conjugated one too), bool and int8 DTensors sharded over WORLD
  ranks are saved as step 1; rank 0 writes the full tensors to OUT/dtypes.pt.
- ``dtypes_restore``: restores step 1 into DTensors sharded over WORLD ranks (plain tensors when WORLD is 1,
  without a process group) and compares them with OUT/dtypes.pt bit for bit.
Prints ``OK`` on success.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import torch
import torch.distributed as dist
from ckpt_helpers import assert_same_tree
from rank_exit import exit_after
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

from vertexrt.checkpoint import CheckpointManager
from vertexrt.errors import CheckpointError


def build() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 8))


def shard(model: torch.nn.Module, world: int) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,))
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)


def full_state(model: torch.nn.Module, opt: torch.optim.Optimizer, sharded: bool) -> dict[str, Any]:
    options = StateDictOptions(full_state_dict=sharded, cpu_offload=sharded)
    model_sd, optim_sd = get_state_dict(model, opt, options=options)
    return {"model": model_sd, "optim": optim_sd}


def dtype_tensors() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(5)
    real = torch.randn(7, 6, generator=gen)
    return {
        "bf16": real.to(torch.bfloat16),
        "fp8_e4m3": real.to(torch.float8_e4m3fn),
        "fp8_e5m2": real.to(torch.float8_e5m2),
        "complex": torch.randn(7, 3, dtype=torch.complex64, generator=gen),
        "conj": torch.randn(7, 3, dtype=torch.complex128, generator=gen).conj(),  # lazily conjugated
        "bool": real > 0,
        "int8": (real * 10).to(torch.int8),
    }


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().resolve_conj().contiguous().reshape(-1).view(torch.uint8)


def sharded(full: torch.Tensor, mesh: Any, rank: int, world: int) -> Any:
    """``full`` as a DTensor sharded by rows, from this rank's rows (gloo has no fp8/bool collectives)."""
    from torch.distributed.tensor import DTensor, Shard

    rows = torch.chunk(full, world, dim=0)[rank]
    return DTensor.from_local(rows, mesh, [Shard(0)], run_check=False, shape=full.shape, stride=full.stride())


def dtypes(mode: str, rank: int, world: int, root: str, out: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    full = dtype_tensors()
    mesh = init_device_mesh("cpu", (world,)) if dist.is_initialized() else None
    mgr = CheckpointManager(root, async_save=False, rank=rank, world_size=world)
    if mode == "dtypes":
        assert mgr.save(1, {"t": {k: sharded(v, mesh, rank, world) for k, v in full.items()}})
        if rank == 0:
            torch.save({k: bits(v) for k, v in full.items()}, os.path.join(out, "dtypes.pt"))
    else:
        zeros = {k: torch.zeros_like(v.resolve_conj()) for k, v in full.items()}
        target = zeros if mesh is None else {k: sharded(v, mesh, rank, world) for k, v in zeros.items()}
        got = mgr.restore({"t": target})["t"]
        for key, value in got.items():
            mine = value if mesh is None else value.to_local()
            want = full[key] if mesh is None else torch.chunk(full[key], world, dim=0)[rank]
            assert mine.dtype == want.dtype and torch.equal(bits(mine), bits(want)), key
            assert (mesh is None or value is target[key]) and not mine.is_conj(), key
    mgr.close()


def main(mode: str, rank: int, world: int, port: int, root: str, out: str, expected: int | None) -> None:
    grouped = mode not in ("restore", "dtypes_restore") or world > 1
    if grouped:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    if mode.startswith("dtypes"):
        dtypes(mode, rank, world, root, out)
        if grouped:
            dist.destroy_process_group()
        print("OK")
        return
    model = build()
    if grouped:
        shard(model, world)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)  # after fully_shard: it trains the DTensor parameters
    mgr = CheckpointManager(root, async_save=False, rank=rank, world_size=world)
    if mode == "save":
        torch.manual_seed(1)
        x, y = torch.randn(4, 16), torch.randn(4, 8)
        for step in (1, 2):
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            assert mgr.save(step, {"model": model, "optim": opt, "step": step}, metrics={"loss": 1.0})
            ref = full_state(model, opt, sharded=True)
            if rank == 0:
                torch.save(ref, os.path.join(out, f"ref_{step}.pt"))
        assert mgr.all_steps() == [1, 2], mgr.all_steps()
    elif mode == "restore":
        got = mgr.restore({"model": model, "optim": opt, "step": 0})
        assert got is not None and got["step"] == expected and mgr.restored_step == expected, got
        assert got["model"] is model and got["optim"] is opt
        state = full_state(model, opt, sharded=world > 1)
        if rank == 0:
            assert_same_tree(torch.load(os.path.join(out, f"ref_{expected}.pt")), state)
        if world > 1:
            dist.barrier()
    elif mode == "nogroup":
        dist.destroy_process_group()
        try:
            mgr.restore({"model": model, "optim": opt})
        except CheckpointError as exc:
            assert "init_torch()" in str(exc) and "torch.distributed" in str(exc), exc
        else:
            raise AssertionError("restoring DTensor state without a process group did not raise")
    mgr.close()
    if grouped and dist.is_initialized():
        dist.destroy_process_group()
    print("OK")


if __name__ == "__main__":
    mode, rank, world, port, root, out = sys.argv[1:7]
    expected = int(sys.argv[7]) if len(sys.argv) > 7 else None
    exit_after(lambda: main(mode, int(rank), int(world), int(port), root, out, expected))

"""How long a fast-tier snapshot blocks the training loop, against durable-only saves at the same cadence.

One process, a state of ``--mib`` MiB of torch tensors (default 128) on ``--device`` (``cpu``, or ``cuda``
on a GPU machine), a simulated 100 ms step (the host sleeps, as it does while a GPU computes), a save every
``--every`` steps. Rows:

- durable sync: ``CheckpointManager(async_save=False)`` to local disk (the caller waits for the write);
- durable async: the durable tier's snapshot + background write;
- fast tier: ``FastTier(every=...)`` (durable never due), local directory ``VERTEXRT_LOCAL_CHECKPOINT_DIR``
  or the default (/dev/shm when it has room).

A first row times a plain parallel host copy of the same bytes (the floor of any CPU snapshot). For each:
the median time ``save()`` blocks on a saving step, and the mean blocking per step as a share of
the step time (the issue's target: <= 5% of a 100 ms step). Medians over ``--repeats`` runs. On ``cuda`` the
blocking is measured until the device copies are done too (``torch.cuda.synchronize()`` after ``save()``), so
a copy that ``save()`` left queued still counts.

Run: .venv/bin/python benchmarks/fast_checkpoint.py [--mib 128] [--every 5] [--steps 40] [--repeats 3]
     [--device cuda]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from typing import Any

MIB = 1 << 20
STEP_SECONDS = 0.1


def build_state(nbytes: int, device: str) -> dict[str, Any]:
    import torch

    gen = torch.Generator().manual_seed(0)
    per = nbytes // 8
    return {"model": {f"w{i}": torch.rand(per // 4, generator=gen).to(device) for i in range(8)}, "step": 0}


def settle(device: str) -> None:
    """Wait for the device's queued copies (a no-op on the CPU)."""
    if device.startswith("cuda"):
        import torch

        torch.cuda.synchronize()


def run(
    kind: str, state: dict[str, Any], every: int, steps: int, root: str, device: str
) -> tuple[float, float]:
    """``(median ms blocked per saving step, mean ms blocked per step)`` of one run."""
    from vertexrt.checkpoint import CheckpointManager, EveryNSteps, FastTier

    durable = os.path.join(root, kind)
    if kind == "fast tier":
        mgr = CheckpointManager(
            durable,
            save_policy=EveryNSteps(10**9),
            fast=FastTier(every=EveryNSteps(every), peers=0, directory=os.environ.get("BENCH_FAST_DIR")),
            rank=0,
            world_size=1,
        )
    else:
        mgr = CheckpointManager(
            durable, save_policy=EveryNSteps(every), async_save=kind == "durable async", rank=0, world_size=1
        )
    blocked: list[float] = []
    total = 0.0
    with mgr:
        for step in range(1, steps + 1):
            time.sleep(STEP_SECONDS)  # the step: the host waits while the accelerator computes
            state["step"] = step
            began = time.perf_counter()
            mgr.save(step, state)
            settle(device)
            spent = time.perf_counter() - began
            if step > every:  # the first save sets up the staging arena: not counted
                total += spent
            if step % every == 0:
                blocked.append(spent)
    shutil.rmtree(durable, ignore_errors=True)
    return statistics.median(blocked[1:]) * 1000, total / (steps - every) * 1000


def _copy_floor(state: dict[str, Any], device: str) -> float:
    """Median ms of copying the state's bytes into a reused host buffer with the staging's threads."""
    from vertexrt.checkpoint import serialization
    from vertexrt.checkpoint.staging import Stager

    leaves = [enc for _, enc in serialization.encode(state, allow_pickle=False)[1]]
    stager = Stager()
    times = []
    for _ in range(7):
        began = time.perf_counter()
        stager.stage(leaves, copy_host=True)
        settle(device)
        times.append(time.perf_counter() - began)
    stager.close()
    return statistics.median(times[1:]) * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=128)
    parser.add_argument("--every", type=int, default=5)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default="cpu", help="where the state lives: cpu or cuda")
    args = parser.parse_args()
    state = build_state(args.mib * MIB, args.device)
    root = tempfile.mkdtemp(prefix="vertexrt-fast-bench-")
    fast_dir = tempfile.mkdtemp(
        prefix="vertexrt-fast-bench-local-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None
    )
    os.environ.setdefault("BENCH_FAST_DIR", fast_dir)
    rows = {"host copy floor": (_copy_floor(state, args.device), 0.0)}
    try:
        for kind in ("durable sync", "durable async", "fast tier"):
            runs = [run(kind, state, args.every, args.steps, root, args.device) for _ in range(args.repeats)]
            rows[kind] = (statistics.median(r[0] for r in runs), statistics.median(r[1] for r in runs))
    finally:
        shutil.rmtree(root, ignore_errors=True)
        shutil.rmtree(fast_dir, ignore_errors=True)
    step_ms = STEP_SECONDS * 1000
    print(
        f"{args.mib} MiB per rank on {args.device}, a save every {args.every} steps of {step_ms:.0f} ms,"
        f" local dir {fast_dir}"
    )
    print(f"{'':<16}{'blocked per save (ms)':>24}{'blocked per step (ms)':>24}{'share of step':>16}")
    for kind, (per_save, per_step) in rows.items():
        amortized = per_step or per_save / args.every
        print(f"{kind:<16}{per_save:>24.1f}{amortized:>24.2f}{amortized / step_ms:>15.1%}")
    for base in ("durable sync", "durable async"):
        print(f"fast tier / {base} blocking per step: {rows['fast tier'][1] / rows[base][1]:.2f}x")


if __name__ == "__main__":
    main()

"""Per-step overhead of ``vertexrt.Trainer.fit()`` over a plain loop, on 2 replicas (gloo), 10 ms steps.

Two local processes form a gloo process group, as two Vertex replicas would. Each runs the same steps
twice, alternating, ``--repeats`` times: a plain ``for`` loop over the batches, and ``Trainer.fit()`` with
its defaults: the context's checkpoint manager (``EveryNSeconds(600)``, the default time policy, asked
after every step), progress tracking, the cross-rank preemption vote after every step, the final
checkpoint. A step sleeps 10 ms (the CPU idles, as it does while a GPU computes).

Each step stamps the clock when it starts and ends; the gap from one step's end to the next one's start
is the loop's own cost. Reported per run (the median over runs, rank 0's stamps):
- between steps, median: the typical per-step cost, robust to the scheduler pausing a process;
- between steps, mean: includes the rare slow steps;
- whole loop: wall time from the first step's start to the last one's end.

Run: .venv/bin/python benchmarks/trainer.py [--steps 300] [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import tempfile
import time
from typing import Any

STEP_SECONDS = 0.010


class Stamps:
    """Start and end times of every step; a step sleeps ``seconds``."""

    def __init__(self, seconds: float = STEP_SECONDS) -> None:
        self.seconds = seconds
        self.starts: list[float] = []
        self.ends: list[float] = []

    def step(self) -> None:
        self.starts.append(time.perf_counter())
        time.sleep(self.seconds)
        self.ends.append(time.perf_counter())

    def summary(self) -> dict[str, float]:
        gaps = [b - a for a, b in zip(self.ends, self.starts[1:], strict=False)]
        return {
            "median_gap": statistics.median(gaps),
            "mean_gap": statistics.fmean(gaps),
            "loop": self.ends[-1] - self.starts[0],
        }


def plain_loop(steps: int) -> dict[str, float]:
    """The baseline: iterate the batches and run the step."""
    stamps = Stamps()
    for _batch in list(range(steps)):
        stamps.step()
    return stamps.summary()


def trainer_loop(steps: int, directory: str, rank: int) -> dict[str, float]:
    """``Trainer.fit()`` with the context's defaults, from an empty checkpoint directory."""
    from vertexrt.checkpoint import CheckpointManager, EveryNSeconds
    from vertexrt.runtime import Context, Trainer

    stamps = Stamps()

    class Bench(Trainer):
        def setup(self) -> None:
            self.train_data = list(range(steps))

        def train_step(self, batch: int) -> dict[str, float]:
            stamps.step()
            return {"loss": 0.0}

        def export(self, model_dir: str) -> None:
            pass

    ctx = Context.create(rank=rank, world_size=2, local_rank=rank)
    ctx.metrics.hypertune = False
    # the same policy as ctx.checkpoints, on a fresh directory per run
    ctx.checkpoints = CheckpointManager(directory, save_policy=EveryNSeconds(600), rank=rank, world_size=2)
    try:
        Bench(ctx, max_epochs=1, progress_interval=3600.0, progress_bar=False).fit()
    finally:
        ctx.close()
    return stamps.summary()


def _worker(rank: int, port: int, steps: int, repeats: int, root: str, out: str) -> None:
    import logging

    import torch.distributed as dist

    logging.disable(logging.WARNING)  # the Trainer's "export not overridden" and such
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    runs: dict[str, list[dict[str, float]]] = {"plain loop": [], "Trainer.fit()": []}
    trainer_loop(20, os.path.join(root, "warm-up"), rank)  # imports, first collectives
    for i in range(repeats):
        dist.barrier()
        runs["plain loop"].append(plain_loop(steps))
        dist.barrier()
        runs["Trainer.fit()"].append(trainer_loop(steps, os.path.join(root, f"run-{i}"), rank))
    dist.barrier()
    dist.destroy_process_group()
    if rank == 0:
        with open(out, "w") as f:
            json.dump(runs, f)


def measure(steps: int, repeats: int) -> dict[str, list[dict[str, float]]]:
    """Run the two processes; rank 0's per-run summaries by loop."""
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory(prefix="vertexrt-bench-") as root:
        os.environ.setdefault("VERTEXRT_LOCAL_DIR", root)
        out = os.path.join(root, "result.json")
        args = (port, steps, repeats, os.path.join(root, "ckpt"), out)
        mp.start_processes(_worker, args=args, nprocs=2, start_method="spawn")
        with open(out) as f:
            result: dict[str, Any] = json.load(f)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    runs = measure(args.steps, args.repeats)

    def median(loop: str, key: str) -> float:
        return statistics.median(run[key] for run in runs[loop])

    step_us = STEP_SECONDS * 1e6
    print(
        f"\nTrainer.fit() vs a plain loop on 2 gloo replicas: {args.steps} steps of {step_us / 1e3:.0f} ms, "
        f"median of {args.repeats} runs"
    )
    print(f"{'':30}{'plain loop':>12}{'Trainer.fit()':>15}{'overhead':>11}{'% of step':>11}")
    for label, key, scale in (
        ("between steps, median (us)", "median_gap", 1e6),
        ("between steps, mean (us)", "mean_gap", 1e6),
        ("whole loop (ms)", "loop", 1e3),
    ):
        plain, fit = median("plain loop", key) * scale, median("Trainer.fit()", key) * scale
        per_step_us = (fit - plain) * (1e6 / scale) / (args.steps if key == "loop" else 1)
        print(f"{label:30}{plain:12.1f}{fit:15.1f}{fit - plain:11.1f}{100 * per_step_us / step_us:10.2f}%")
    print("target: the per-step overhead <= 1% of a 10 ms step (100 us)")


if __name__ == "__main__":
    main()

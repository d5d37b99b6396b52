"""Per-step overhead of ``vertexrt.Trainer.fit()`` over a plain Python loop, on ~1 ms steps.

Both loops run the same step: a 1 ms busy wait (exact and CPU-bound, like a small model's step). The
Trainer run has everything on: progress tracking, the preemption check after every step, the checkpoint
manager's save policy asked after every step (saving every 500 steps, in the background), an evaluation
per epoch and the final checkpoint.

Three measures, each the median of ``--repeats`` runs:
- whole run: wall time of the loop (fixed costs and scheduler noise included);
- empty steps: steps that do nothing, 10x as many, no checkpoint before the final one: the loop's own
  bookkeeping per step with warm caches (fixed costs spread over the steps);
- between steps: each 1 ms step stamps the clock when it starts and ends; the gap from one step's end to
  the next one's start is the loop's own cost (the plain loop's is a ``for`` over a list). The median gap
  is robust to the scheduler pausing the process on a busy machine; the mean includes the amortised
  checkpoint saves and such pauses.

A second table: the per-step preemption agreement across 2 gloo processes (what every distributed step
adds), a blocking all-reduce as a hand-written loop would do it vs ``Context.should_stop()``, which runs
the all-reduce in the background and reads it at the next step.

Run: .venv/bin/python benchmarks/trainer.py [--steps 3000] [--repeats 5]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

STEP_SECONDS = 0.001


class Stamps:
    """Start and end times of every step; a step busy-waits ``seconds``."""

    def __init__(self, seconds: float = STEP_SECONDS) -> None:
        self.seconds = seconds
        self.starts: list[float] = []
        self.ends: list[float] = []

    def step(self) -> None:
        now = time.perf_counter()
        self.starts.append(now)
        end = now + self.seconds
        while time.perf_counter() < end:
            pass
        self.ends.append(time.perf_counter())

    def gaps(self) -> list[float]:
        return [b - a for a, b in zip(self.ends, self.starts[1:], strict=False)]


def plain_loop(steps: int, seconds: float = STEP_SECONDS) -> tuple[float, list[float]]:
    """The baseline: iterate the data and run the step."""
    data, stamps = list(range(steps)), Stamps(seconds)
    start = time.perf_counter()
    for _batch in data:
        stamps.step()
    return time.perf_counter() - start, stamps.gaps()


def trainer_loop(
    steps: int, root: str, seconds: float = STEP_SECONDS, save_every: int = 500
) -> tuple[float, list[float]]:
    from vertexrt.checkpoint import CheckpointManager, EveryNSteps, KeepLast
    from vertexrt.runtime import Context, Trainer

    stamps = Stamps(seconds)

    class Bench(Trainer):
        def setup(self) -> None:
            self.train_data = list(range(steps))

        def train_step(self, batch: int) -> dict[str, float]:
            stamps.step()
            return {"loss": 0.0}

        def evaluate(self) -> dict[str, float]:
            return {"score": 1.0}

        def export(self, model_dir: str) -> None:
            pass

    ctx = Context.create()
    ctx.install_preemption_handler()
    ctx.metrics.hypertune = False
    directory = tempfile.mkdtemp(dir=root)
    policy = EveryNSteps(save_every)
    ctx.checkpoints = CheckpointManager(directory, save_policy=policy, keep_policy=KeepLast(2))
    trainer = Bench(ctx, max_epochs=1, progress_interval=3600.0, progress_bar=False)
    start = time.perf_counter()
    trainer.fit()
    elapsed = time.perf_counter() - start
    ctx.close()
    return elapsed, stamps.gaps()


def _agreement_worker(rank: int, port: int, checks: int, out: str) -> None:
    """One of two gloo processes: time the per-step preemption agreement, blocking vs in the background."""
    import json

    import torch.distributed as dist

    from vertexrt.checkpoint.collective import any_rank
    from vertexrt.runtime.vote import StopVote

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    vote = StopVote()
    ways = {"blocking all-reduce": lambda: any_rank(False, dist), "vertexrt (StopVote)": lambda: vote(False)}
    result = {}
    for name, check in ways.items():
        spent = []
        for _ in range(checks):
            time.sleep(STEP_SECONDS)  # a step that leaves the CPU idle, as a GPU-bound step does
            start = time.perf_counter()
            check()
            spent.append(time.perf_counter() - start)
        result[name] = statistics.median(spent)
    vote.drain()
    dist.destroy_process_group()
    if rank == 0:
        with open(out, "w") as f:
            json.dump(result, f)


def agreement(checks: int) -> dict[str, float]:
    import json
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        mp.start_processes(_agreement_worker, args=(port, checks, out), nprocs=2, start_method="spawn")
        with open(out) as f:
            return dict(json.load(f))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3000)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    os.environ.setdefault("VERTEXRT_LOCAL_DIR", tempfile.mkdtemp(prefix="vertexrt-bench-"))
    runs: dict[str, list[tuple[float, list[float]]]] = {"plain": [], "trainer": []}
    empty: dict[str, list[float]] = {"plain": [], "trainer": []}
    with tempfile.TemporaryDirectory(prefix="vertexrt-bench-ckpt-") as root:
        trainer_loop(50, root)  # warm-up: imports
        for _ in range(args.repeats):
            runs["plain"].append(plain_loop(args.steps))
            runs["trainer"].append(trainer_loop(args.steps, root))
            # Empty steps: the loop's own cost with warm caches (whole fit() over 10x the steps).
            empty["plain"].append(plain_loop(10 * args.steps, 0.0)[0] / (10 * args.steps))
            empty_fit = trainer_loop(10 * args.steps, root, 0.0, save_every=10**9)[0]
            empty["trainer"].append(empty_fit / (10 * args.steps))

    def summary(name: str) -> tuple[float, float, float]:
        wall = statistics.median(t for t, _ in runs[name])
        median_gap = statistics.median(statistics.median(g) for _, g in runs[name])
        mean_gap = statistics.median(statistics.fmean(g) for _, g in runs[name])
        return wall, median_gap, mean_gap

    plain, fit = summary("plain"), summary("trainer")
    print(
        f"\nTrainer.fit() vs a plain loop: {args.steps} steps of {STEP_SECONDS * 1e3:.0f} ms, "
        f"median of {args.repeats} runs"
    )
    print(f"{'':36}{'plain loop':>12}{'Trainer.fit()':>15}{'overhead':>11}{'% of step':>11}")
    e_plain, e_fit = statistics.median(empty["plain"]) * 1e6, statistics.median(empty["trainer"]) * 1e6
    rows = (
        ("whole run (s)", plain[0], fit[0], fit[0] - plain[0], 100 * (fit[0] - plain[0]) / plain[0]),
        (f"empty steps, per step, {10 * args.steps} (us)", e_plain, e_fit, e_fit - e_plain, None),
        ("between steps, median (us)", plain[1] * 1e6, fit[1] * 1e6, (fit[1] - plain[1]) * 1e6, None),
        ("between steps, mean (us)", plain[2] * 1e6, fit[2] * 1e6, (fit[2] - plain[2]) * 1e6, None),
    )
    for label, a, b, diff, pct in rows:
        share = pct if pct is not None else 100 * diff / (STEP_SECONDS * 1e6)
        print(f"{label:36}{a:12.3f}{b:15.3f}{diff:11.3f}{share:10.2f}%")
    print("target: the median per-step overhead <= 1% of a 1 ms step (10 us)")

    results = [agreement(500) for _ in range(args.repeats)]
    print("\nPreemption check agreed across 2 gloo processes, after each 1 ms idle step (median per check)")
    base = statistics.median(r["blocking all-reduce"] for r in results) * 1e6
    for name in results[0]:
        cost = statistics.median(r[name] for r in results) * 1e6
        share = 100 * cost / (STEP_SECONDS * 1e6)
        print(f"{name:36}{cost:12.1f} us{cost / base:9.3f}x{share:10.2f}% of step")


if __name__ == "__main__":
    main()

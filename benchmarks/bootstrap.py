"""Time from process start to the first completed all_reduce: vertexrt local-run + init_torch() vs
torchrun --standalone, 2 and 4 gloo processes on this machine.

    .venv/bin/python benchmarks/bootstrap.py [--repeats 3]

Each run starts the launcher, every rank prints the wall-clock time of its first completed all_reduce, and
the run's time is the last rank's minus the launch time (median over repeats). "exit" is the time until the
launcher has exited (teardown included).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time


def worker(mode: str) -> None:
    import torch
    import torch.distributed as dist

    if mode == "vertexrt":
        from vertexrt.distributed import init_torch

        init_torch(backend="gloo")
    else:
        dist.init_process_group("gloo")
    value = torch.ones(1)
    dist.all_reduce(value)
    os.write(1, f"DONE {time.time():.6f} {value.item():.0f}\n".encode())  # one write: stdout may be shared
    dist.destroy_process_group()


def configurations(n: int) -> list[tuple[str, list[str], str]]:
    me = os.path.abspath(__file__)
    py = sys.executable
    torchrun = [py, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={n}"]
    local_run = [py, "-m", "vertexrt.distributed.launcher"]
    rows = [
        ("torchrun --standalone + init_process_group", [*torchrun, me, "--worker", "plain"], "plain"),
        ("torchrun --standalone + init_torch()", [*torchrun, me, "--worker", "vertexrt"], "vertexrt"),
        (
            f"local-run --workers {n} + init_torch()",
            [*local_run, "--workers", str(n), "--", py, me, "--worker", "vertexrt"],
            "vertexrt",
        ),
    ]
    if n % 2 == 0:
        rows.append(
            (
                f"local-run --workers {n // 2} --processes-per-node 2 + init_torch()",
                [
                    *local_run,
                    "--workers",
                    str(n // 2),
                    "--processes-per-node",
                    "2",
                    "--",
                    py,
                    me,
                    "--worker",
                    "vertexrt",
                ],
                "vertexrt",
            )
        )
    return rows


def measure(argv: list[str], n: int) -> tuple[float, float]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    for name in (
        "CLUSTER_SPEC",
        "TF_CONFIG",
        "MASTER_ADDR",
        "MASTER_PORT",
        "RANK",
        "WORLD_SIZE",
        "LOCAL_RANK",
    ):
        env.pop(name, None)
    with tempfile.TemporaryDirectory() as cwd:
        start = time.time()
        proc = subprocess.run(argv, env=env, cwd=cwd, capture_output=True, text=True, timeout=300)
        exited = time.time() - start
    marks = [line[line.index("DONE ") :].split() for line in proc.stdout.splitlines() if "DONE " in line]
    done = [float(mark[1]) for mark in marks]
    sums = {mark[2] for mark in marks}
    if proc.returncode != 0 or len(done) != n or sums != {str(n)}:
        raise SystemExit(f"{argv} failed ({proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    return max(done) - start, exited


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--worker", choices=["plain", "vertexrt"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker)
        return
    rows = []
    for n in (2, 4):
        baseline = None
        for name, argv, _ in configurations(n):
            runs = [measure(argv, n) for _ in range(args.repeats)]
            first = statistics.median(r[0] for r in runs)
            exit_ = statistics.median(r[1] for r in runs)
            baseline = baseline or first
            rows.append((n, name, first, exit_, first / baseline))
            print(f"  {n} procs  {name}: {first:.2f}s", file=sys.stderr, flush=True)
    print(f"\nfirst all_reduce after launch, median of {args.repeats} (ratio vs torchrun --standalone)")
    print(f"{'procs':>5}  {'launcher':<62} {'first':>7} {'exit':>7} {'ratio':>6}")
    for n, name, first, exit_, ratio in rows:
        print(f"{n:>5}  {name:<62} {first:>6.2f}s {exit_:>6.2f}s {ratio:>5.2f}x")


if __name__ == "__main__":
    main()

"""SIGKILL a checkpoint writer at random moments, over and over, and check nothing committed is ever corrupt.

Each round starts a writer process that resumes from the newest checkpoint and saves (asynchronously, with
KeepLast(2) retention, several data files per step) until it is SIGKILLed after a random delay. Then every
committed step is restored with its checksums verified and compared bit for bit with the state it must hold,
and the newest committed step must never go backwards.

Run: .venv/bin/python scripts/kill_torture.py [--kills 500] [--storage local|gcs|fuse|all] [--max-delay 0.5]
Prints e.g. ``500 kills, 0 corrupt`` and exits 1 if anything was corrupt.
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from typing import Any


def make_state(step: int) -> dict[str, Any]:
    """The state saved at ``step``: a pure function of it."""
    import numpy as np

    rng = np.random.default_rng(step)
    return {
        "step": step,
        "arrays": [rng.integers(0, 2**31, size=n, dtype=np.int64) for n in (150_000, 30_000, 260_000)],
        "meta": {"name": f"run-{step}", "lr": 0.1 / (step + 1)},
        "blob": rng.bytes(1000),
    }


def same(got: dict[str, Any], want: dict[str, Any]) -> bool:
    import numpy as np

    return (
        got["step"] == want["step"]
        and got["meta"] == want["meta"]
        and got["blob"] == want["blob"]
        and all(
            a.dtype == b.dtype and np.array_equal(a, b)
            for a, b in zip(got["arrays"], want["arrays"], strict=True)
        )
    )


def writer(root: str) -> None:
    """The victim: resume, then save forever."""
    from vertexrt.checkpoint import CheckpointManager, KeepLast

    mgr = CheckpointManager(root, keep_policy=KeepLast(2))
    mgr._strategy.part_size = 256 << 10  # several data files per step
    latest = mgr.latest_step()
    print("ready", flush=True)
    step = 0 if latest is None else latest + 1
    while True:
        mgr.save(step, make_state(step))
        step += 1


def check(root: str) -> tuple[int | None, list[str]]:
    """The newest committed step and the problems found in any committed step."""
    from vertexrt.checkpoint import CheckpointManager

    problems = []
    with CheckpointManager(root, async_save=False) as mgr:
        steps = mgr.all_steps()
        for step in steps:
            try:
                if not same(mgr.restore(step=step), make_state(step)):
                    problems.append(f"step {step}: restored state differs")
            except Exception as exc:
                problems.append(f"step {step}: {type(exc).__name__}: {exc}")
    return (steps[-1] if steps else None), problems


def torture(root: str, kills: int, max_delay: float, rng: random.Random) -> tuple[int, int, int]:
    corrupt, previous = 0, -1
    for i in range(kills):
        proc = subprocess.Popen(
            [sys.executable, __file__, "--writer", root],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        try:
            assert proc.stdout is not None
            if proc.stdout.readline().strip() != "ready":
                raise RuntimeError("the writer did not start")
            time.sleep(rng.uniform(0.0, max_delay))
        finally:
            proc.kill()
            proc.wait(timeout=60)
        latest, problems = check(root)
        latest = -1 if latest is None else latest
        if latest < previous:
            problems.append(f"newest committed step went back from {previous} to {latest}")
        if problems:
            corrupt += 1
            print(f"  kill {i + 1}: {'; '.join(problems)}", flush=True)
        previous = max(previous, latest)
        if (i + 1) % 50 == 0:
            print(f"  {root}: {i + 1} kills, {corrupt} corrupt, newest step {previous}", flush=True)
    return kills, corrupt, previous


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kills", type=int, default=500)
    parser.add_argument("--storage", choices=["local", "gcs", "fuse", "all"], default="all")
    parser.add_argument(
        "--max-delay", type=float, default=None, help="longest wait before a kill, s (default 0.5; 2 on gcs)"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--writer", metavar="ROOT", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.writer:
        writer(args.writer)
        return 0
    os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")
    kinds = ["local", "gcs", "fuse"] if args.storage == "all" else [args.storage]
    rng = random.Random(args.seed)
    scratch = tempfile.mkdtemp(prefix="kill-torture-")
    server = None
    total = corrupt = 0
    try:
        for index, kind in enumerate(kinds):
            share = args.kills // len(kinds) + (1 if index < args.kills % len(kinds) else 0)
            if kind == "local":
                root = os.path.join(scratch, "local")
            elif kind == "fuse":
                os.environ["VERTEXRT_FUSE_ROOT"] = os.path.join(scratch, "mnt")
                os.makedirs(os.path.join(scratch, "mnt", "bucket"), exist_ok=True)
                root = "/gcs/bucket/ckpt"
            else:
                from vertexrt.emulator import GCSServer

                server = GCSServer(buckets=["torture"], log_path=os.path.join(scratch, "gcs.log")).start()
                os.environ["STORAGE_EMULATOR_HOST"] = server.endpoint
                root = "gs://torture/ckpt"
            delay = args.max_delay if args.max_delay is not None else (2.0 if kind == "gcs" else 0.5)
            done, bad, newest = torture(root, share, delay, rng)
            print(f"{kind}: {done} kills, {bad} corrupt (newest committed step {newest})", flush=True)
            total += done
            corrupt += bad
    except Exception:
        traceback.print_exc()
        return 2
    finally:
        if server is not None:
            server.stop()
        shutil.rmtree(scratch, ignore_errors=True)
    print(f"{total} kills, {corrupt} corrupt")
    return 1 if corrupt else 0


if __name__ == "__main__":
    sys.exit(main())

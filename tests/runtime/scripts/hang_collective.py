"""A gloo job in which rank 1 skips one all_reduce at step ``--skip-at`` and goes on beating elsewhere, so
rank 0 hangs in the collective. With ``--once MARKER`` it skips only while MARKER does not exist (it creates
it), checkpoints every 2 steps and resumes from the last checkpoint: the restarted job finishes.
"""

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from vertexrt.checkpoint import CheckpointManager, EveryNSteps
from vertexrt.distributed import init_torch
from vertexrt.runtime.watchdog import HangWatchdog

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=8)
parser.add_argument("--skip-at", type=int, default=5)
parser.add_argument("--timeout", type=float, default=3.0)
parser.add_argument("--once", default=None)
args = parser.parse_args()

watchdog = HangWatchdog(args.timeout).start()  # before init: the flight recorder is turned on
handle = init_torch(timeout=600)  # far longer than the watchdog: gloo alone would wait 10 minutes
manager = CheckpointManager(save_policy=EveryNSteps(2)) if args.once else None
state = {"step": 0, "total": torch.zeros(1)}
restored = manager.restore(target=state) if manager else None
if restored:
    state = restored
first = state["step"]
skip = handle.rank == 1 and (args.once is None or not Path(args.once).exists())
watchdog.beat(first)
for step in range(first + 1, args.steps + 1):
    value = torch.ones(1)
    if skip and step == args.skip_at:
        if args.once:
            Path(args.once).touch()
        while True:  # rank 1 went on without its peer: alive, beating, never joining the collective
            watchdog.beat(step)
            time.sleep(0.05)
    dist.all_reduce(value)
    state["total"] += value
    state["step"] = step
    if manager:
        manager.save(step, state)
    watchdog.beat(step)
if manager:
    manager.close()
watchdog.stop()
record = {"rank": handle.rank, "first": first, "step": state["step"], "total": state["total"].item()}
os.write(1, f"RESULT {json.dumps(record)}\n".encode())
handle.shutdown()
sys.exit(0)

"""Subprocess for the kill tests: resumes from the newest checkpoint and saves forever until killed.

Usage: python kill_writer.py ROOT. Prints ``ready``, then ``committed N`` once step N is committed.
"""

from __future__ import annotations

import sys

from ckpt_helpers import make_state

from vertexrt.checkpoint import CheckpointManager, KeepLast


def main(root: str) -> None:
    mgr = CheckpointManager(root, keep_policy=KeepLast(2))
    mgr._strategy.part_size = 256 << 10  # several data files per step: more places to be killed in
    latest = mgr.latest_step()
    start = 0 if latest is None else latest + 1
    print("ready", flush=True)
    for step in range(start, start + 100_000):
        mgr.save(step, make_state(step))  # returns once the save before it (one in flight) is committed
        if step > start:
            print(f"committed {step - 1}", flush=True)
    mgr.close()


if __name__ == "__main__":
    main(sys.argv[1])

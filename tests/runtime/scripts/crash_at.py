"""A training script that fails as told, for the crash-loop guard: ``crash_at.py MODE``.

``always``: a ValueError at step 7 on every attempt. ``moving``: a ValueError at step 6 + the attempt
number on the first two attempts (another step each time), then it finishes. ``preempted``: preempted at
step 4 (saved, exit 143) on the first two attempts, a ValueError at step 7 on the third, and it finishes on
the fourth.
Each attempt counts itself in a file under ``AIP_CHECKPOINT_DIR`` and prints ``attempt N``.
"""

import sys
from pathlib import Path

import vertexrt
from vertexrt.runtime import Preempted

MODE = sys.argv[1]


@vertexrt.main
def train(ctx: vertexrt.Context) -> None:
    counter = Path(ctx.env.checkpoint_dir) / "attempt-count"
    attempt = int(counter.read_text()) + 1 if counter.exists() else 1
    counter.parent.mkdir(parents=True, exist_ok=True)
    counter.write_text(str(attempt))
    print(f"attempt {attempt}", flush=True)
    for step in range(1, 11):
        if MODE == "always" and step == 7:
            raise ValueError("a bad batch at step 7")
        if MODE == "moving" and attempt <= 2 and step == 6 + attempt:
            raise ValueError(f"a flaky read at step {step}")
        if MODE == "preempted" and attempt <= 2 and step == 4:
            raise Preempted(step)  # as the Trainer does after its preemption save
        if MODE == "preempted" and attempt == 3 and step == 7:
            raise ValueError("a bad batch at step 7")
        ctx.step(step)
    print("finished", flush=True)


if __name__ == "__main__":
    train()

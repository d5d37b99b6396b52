"""Train a small model with periodic checkpoints; kill it at any moment and run it again to resume.

The model, optimizer, step and RNG states are checkpointed, so a run that is killed (SIGKILL) and resumed
ends with exactly the same weights as a run that never stopped. On SIGTERM (a Vertex preemption notice) it
saves at the next step boundary and exits with status 143.

    python examples/checkpoint_resume.py --dir /tmp/ckpt --steps 300       # kill it, run it again
    python examples/checkpoint_resume.py --dir gs://my-bucket/run1/ckpt    # or on Cloud Storage

On Vertex AI, leave out --dir: checkpoints go to AIP_CHECKPOINT_DIR.
"""

from __future__ import annotations

import argparse
import hashlib
import logging
import sys
import time

import torch

from vertexrt.checkpoint import PREEMPTED_EXIT_CODE, CheckpointManager, EveryNSteps, KeepLast, rng_state


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", default=None, help="checkpoint directory (default: AIP_CHECKPOINT_DIR)")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--every", type=int, default=25, help="save every N steps")
    parser.add_argument("--sleep", type=float, default=0.0, help="seconds per step (to have time to kill it)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    true_w = torch.linspace(-1, 1, 16)
    state = {"model": model, "opt": opt, "step": -1, "rng": rng_state()}

    with CheckpointManager(
        args.dir, save_policy=EveryNSteps(args.every), keep_policy=KeepLast(3), save_on_preemption=True
    ) as mgr:
        restored = mgr.restore(target=state)
        start = 0 if restored is None else restored["step"] + 1
        print(f"resumed from step {restored['step']}" if restored else "fresh start", flush=True)
        loss = torch.tensor(float("nan"))
        for step in range(start, args.steps):
            x = torch.randn(32, 16)
            y = (x @ true_w).unsqueeze(1) + 0.01 * torch.randn(32, 1)
            loss = torch.nn.functional.mse_loss(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            state["step"] = step
            if mgr.preemption_requested():
                mgr.save(step, state, force=True)
                print(f"preempted: saved step {step}", flush=True)
                return PREEMPTED_EXIT_CODE
            if mgr.save(step, state, metrics={"loss": loss.item()}):
                print(f"saving step {step}", flush=True)
            time.sleep(args.sleep)
    digest = hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in model.parameters())).hexdigest()
    print(f"done: loss {loss.item():.5f} weights {digest[:16]}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

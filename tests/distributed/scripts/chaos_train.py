"""A tiny resumable training job for ``local-run --chaos`` tests: SGD with momentum on one weight, in pure
Python. ``--forget-momentum`` restores the weight but not the optimizer's momentum (a resume bug)."""

import argparse
import json
import os
import random
import time

import vertexrt
from vertexrt.checkpoint import CheckpointManager, EveryNSteps

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=12)
parser.add_argument("--forget-momentum", action="store_true")
parser.add_argument("--step-delay", type=float, default=0.0)


@vertexrt.main(parser=parser)
def main(ctx: vertexrt.Context, args: argparse.Namespace) -> None:
    ctx.checkpoints = CheckpointManager(
        os.path.join(ctx.env.checkpoint_dir, f"replica-{ctx.rank}"),
        save_policy=EveryNSteps(4),
        rank=0,
        world_size=1,
    )
    state = {"w": 0.0, "momentum": 0.0, "step": 0}
    restored = ctx.checkpoints.restore()
    if restored is not None:
        state["w"], state["step"] = restored["w"], restored["step"]
        if not args.forget_momentum:
            state["momentum"] = restored["momentum"]
    while state["step"] < args.steps:
        target = random.Random(state["step"]).uniform(1.0, 2.0)  # the data of this step
        grad = 2 * (state["w"] - target)
        state["momentum"] = 0.9 * state["momentum"] + grad
        state["w"] -= 0.05 * state["momentum"]
        state["step"] += 1
        time.sleep(args.step_delay)
        ctx.step(state["step"])
        if ctx.should_stop():
            ctx.checkpoints.save(state["step"], dict(state), force=True)
            return
        ctx.checkpoints.save(state["step"], dict(state))
    ctx.metrics.report({"loss": (state["w"] - 1.5) ** 2}, step=state["step"])
    if ctx.is_chief:
        os.makedirs(ctx.env.model_dir, exist_ok=True)
        with open(os.path.join(ctx.env.model_dir, "model.json"), "w") as f:
            json.dump({"w": state["w"], "steps": state["step"]}, f)


if __name__ == "__main__":
    main()

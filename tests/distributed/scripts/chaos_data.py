"""A resumable job over a vertexrt dataset for ``local-run --chaos`` data audit tests: each step takes a
batch of records; the weight it trains does not depend on them (so only the data audit can tell a run
that delivers the wrong records). ``--forget-data`` restores the weight and the step but not the reader's
state: a resumed epoch reads its first records again and never the rest (a resume bug)."""

import argparse
import itertools
import json
import os
import random

import vertexrt
from vertexrt.checkpoint import CheckpointManager, EveryNSteps

parser = argparse.ArgumentParser()
parser.add_argument("--data", required=True)
parser.add_argument("--epochs", type=int, default=2)
parser.add_argument("--batch", type=int, default=4)
parser.add_argument("--forget-data", action="store_true")


@vertexrt.main(parser=parser)
def main(ctx: vertexrt.Context, args: argparse.Namespace) -> None:
    ctx.checkpoints = CheckpointManager(
        os.path.join(ctx.env.checkpoint_dir, "replica-0"), save_policy=EveryNSteps(3), rank=0, world_size=1
    )
    ds = vertexrt.open_dataset(args.data, shuffle=True, seed=5, shuffle_buffer=8, rank=0, world_size=1)
    per_epoch = ds.count() // args.batch
    state = {"w": 0.0, "step": 0, "data": None}
    restored = ctx.checkpoints.restore()
    if restored is not None:
        state.update(restored)
        if not args.forget_data:
            ds.load_state_dict(restored["data"])
    while state["step"] < args.epochs * per_epoch:
        epoch = state["step"] // per_epoch
        ds.set_epoch(epoch)
        records = iter(ds)
        for _ in range(state["step"] % per_epoch, per_epoch):
            batch = list(itertools.islice(records, args.batch))
            assert len(batch) == args.batch, batch
            target = random.Random(state["step"]).uniform(1.0, 2.0)  # not the batch: see the docstring
            state["w"] += 0.1 * (target - state["w"])
            state["step"] += 1
            state["data"] = ds.state_dict()
            ctx.step(state["step"])
            if ctx.should_stop():
                ctx.checkpoints.save(state["step"], dict(state), force=True)
                return
            ctx.checkpoints.save(state["step"], dict(state))
    if ctx.is_chief:
        os.makedirs(ctx.env.model_dir, exist_ok=True)
        with open(os.path.join(ctx.env.model_dir, "model.json"), "w") as f:
            json.dump({"w": state["w"], "steps": state["step"]}, f)


if __name__ == "__main__":
    main()

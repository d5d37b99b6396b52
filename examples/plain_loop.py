"""A training loop with nothing but ``import vertexrt``: no torch, no TensorFlow, no numpy in this file.

Fits a linear regression by SGD in pure Python on synthetic JSONL data that the chief first writes next to
the job's output directories (the local directory or bucket standing in for Cloud Storage). It shows the
parts a hand-written loop uses: ``@vertexrt.main`` (logging, SIGTERM handler, arguments, exit codes), the
Vertex output directories, a sharded resumable reader, a checkpoint manager, ``ctx.should_stop()`` for
preemption, hypertune reporting, and the export to ``AIP_MODEL_DIR``.

    python examples/plain_loop.py
    vertexrt local-run --workers 2 -- python examples/plain_loop.py
    vertexrt local-run --preempt-after 4 -- python examples/plain_loop.py --step-delay 0.002

Without a framework there is no gradient exchange: under ``--workers 2`` each replica fits its own shard
and keeps its own checkpoints (``<AIP_CHECKPOINT_DIR>/replica-<rank>``); the chief exports its model.
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import time
from typing import Any

import vertexrt
import vertexrt.data
from vertexrt import paths
from vertexrt.checkpoint import CheckpointManager, EveryNSteps, KeepLast

logger = logging.getLogger("plain_loop")

TRUE_WEIGHTS, TRUE_BIAS = [2.0, -1.0, 0.5, 3.0], 0.25


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument("--records", type=int, default=2000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--checkpoint-every", type=int, default=500, help="steps between checkpoints")
    parser.add_argument("--step-delay", type=float, default=0.0, help="seconds of extra work per step")
    return parser


def write_data(root: str, records: int, seed: int) -> None:
    """Two training shards and a validation file of ``{"x": [...], "y": ...}`` lines, then a marker."""
    rng = random.Random(seed)

    def line() -> str:
        x = [round(rng.uniform(-1.0, 1.0), 4) for _ in TRUE_WEIGHTS]
        y = sum(w * v for w, v in zip(TRUE_WEIGHTS, x, strict=True)) + TRUE_BIAS + rng.gauss(0.0, 0.1)
        return json.dumps({"x": x, "y": round(y, 4)}) + "\n"

    for name, count in (("train-0.jsonl", records // 2), ("train-1.jsonl", records // 2), ("val.jsonl", 200)):
        with paths.open(paths.join(root, name), "w") as f:
            f.write("".join(line() for _ in range(count)))
    with paths.open(paths.join(root, "_SUCCESS"), "w") as f:
        f.write("ok")


def exists(uri: str) -> bool:
    fs, path = paths.filesystem(uri)
    return bool(fs.exists(path))


def wait_for(uri: str, timeout: float = 120.0) -> None:
    """Non-chief replicas wait for the chief's data (there is no framework barrier here)."""
    deadline = time.monotonic() + timeout
    while not exists(uri):
        if time.monotonic() > deadline:
            raise vertexrt.ConfigError(f"{uri} did not appear within {timeout:.0f} s: did the chief fail?")
        time.sleep(0.2)


def predict(w: list[float], b: float, x: list[float]) -> float:
    return sum(wi * xi for wi, xi in zip(w, x, strict=True)) + b


def mean_squared_error(w: list[float], b: float, uri: str) -> float:
    reader = vertexrt.data.open_dataset(uri, "jsonl", shuffle=False, rank=0, world_size=1)
    errors = [(predict(w, b, r["x"]) - r["y"]) ** 2 for r in reader]
    return sum(errors) / len(errors)


@vertexrt.main(parser=build_parser())
def main(ctx: vertexrt.Context, args: argparse.Namespace) -> None:
    root = paths.join(ctx.env.model_dir.rsplit("/", 1)[0], "data")
    marker = paths.join(root, "_SUCCESS")
    if ctx.is_chief and not exists(marker):
        write_data(root, args.records, args.seed)
        logger.info("wrote synthetic data to %s", root)
    wait_for(marker)

    reader = vertexrt.data.open_dataset(paths.join(root, "train-*.jsonl"), "jsonl", seed=args.seed)
    ctx.checkpoints = CheckpointManager(
        paths.join(ctx.env.checkpoint_dir, f"replica-{ctx.rank}"),
        save_policy=EveryNSteps(args.checkpoint_every),
        keep_policy=KeepLast(2),
        rank=0,
        world_size=1,  # each replica checkpoints on its own
    )
    state: dict[str, Any] = {"w": [0.0] * len(TRUE_WEIGHTS), "b": 0.0, "step": 0, "epoch": 0, "data": reader}
    restored = ctx.checkpoints.restore(target=state)  # the reader's position is loaded in place
    if restored is not None:
        state.update(restored)
        logger.info("resumed at step %d (epoch %d)", state["step"], state["epoch"])

    saved = state["step"]
    for epoch in range(state["epoch"], args.epochs):
        state["epoch"] = epoch
        reader.set_epoch(epoch)  # keeps a restored position in this epoch
        for record in reader:
            error = predict(state["w"], state["b"], record["x"]) - record["y"]
            state["w"] = [w - args.lr * error * x for w, x in zip(state["w"], record["x"], strict=True)]
            state["b"] -= args.lr * error
            state["step"] += 1
            ctx.step(state["step"])  # the hang watchdog and `local-run --chaos` count steps here
            if args.step_delay:
                time.sleep(args.step_delay)
            if ctx.should_stop():  # SIGTERM: save now; @main then exits 143 and the job restarts
                ctx.checkpoints.save(state["step"], state, force=True)
                return
            if ctx.checkpoints.save(state["step"], state):  # when the save policy says so
                saved = state["step"]
        mse = mean_squared_error(state["w"], state["b"], paths.join(root, "val.jsonl"))
        ctx.metrics.report({"mse": mse}, step=state["step"])

    state["epoch"] = args.epochs
    if saved != state["step"]:
        ctx.checkpoints.save(state["step"], state, force=True)
    if ctx.is_chief:
        model = {"weights": state["w"], "bias": state["b"], "steps": state["step"]}
        with paths.open(paths.join(ctx.env.model_dir, "model.json"), "w") as f:
            f.write(json.dumps(model))
        logger.info(
            "final mse=%.5f; model exported to %s",
            ctx.metrics.latest["mse"],
            ctx.env.model_dir + "/model.json",
        )


if __name__ == "__main__":
    main()

"""A hyperparameter-tuning trial with no framework: fit a line by SGD, report the metric every epoch.

Vertex runs this once per trial with the study's parameters as flags (`--learning_rate=0.05
--batch_size=32.0 ...`); `vertexrt.hypertune` parses them and writes the file the tuning service reads.
Only the chief reports, so it also runs unchanged as several replicas.

    python examples/hptuning_trial.py --learning_rate=0.05 --batch_size=32.0
    vertexrt local-run --workers 2 -- python examples/hptuning_trial.py --epochs 3
    cat /tmp/hypertune/output.metrics     # or $CLOUD_ML_HP_METRIC_FILE
"""

from __future__ import annotations

import argparse
import json
import logging
import random

from vertexrt import hypertune, paths
from vertexrt.env import environment

METRIC = "val_mse"  # the study's metricId (CLOUD_ML_HP_METRIC_TAG is checked against it)


def synthetic(n: int, seed: int) -> list[tuple[float, float]]:
    """y = 3x - 1 plus noise."""
    rng = random.Random(seed)
    return [(x, 3 * x - 1 + rng.gauss(0, 0.1)) for x in (rng.uniform(-1, 1) for _ in range(n))]


def mse(w: float, b: float, rows: list[tuple[float, float]]) -> float:
    return sum((w * x + b - y) ** 2 for x, y in rows) / len(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--learning_rate", type=float, default=0.1)
    parser.add_argument("--batch_size", type=int, default=16)  # the tuner sends "16.0": parse_args copes
    parser.add_argument("--epochs", type=int, default=5)
    args = hypertune.parse_args(parser, ignore_unknown=True)

    env = environment()
    train, val = synthetic(2000, seed=0), synthetic(500, seed=1)
    rng = random.Random(42)
    w = b = 0.0
    for epoch in range(1, args.epochs + 1):
        rng.shuffle(train)
        for start in range(0, len(train), args.batch_size):
            batch = train[start : start + args.batch_size]
            grad_w = sum(2 * (w * x + b - y) * x for x, y in batch) / len(batch)
            grad_b = sum(2 * (w * x + b - y) for x, y in batch) / len(batch)
            w, b = w - args.learning_rate * grad_w, b - args.learning_rate * grad_b
        val_mse = mse(w, b, val)
        logging.info("epoch %d: w=%.4f b=%.4f %s=%.5f", epoch, w, b, METRIC, val_mse)
        hypertune.report(METRIC, val_mse, step=epoch)  # a no-op on non-chief replicas

    if hypertune.is_chief():
        model = paths.join(env.model_dir, "model.json")
        with paths.open(model, "w") as f:
            f.write(json.dumps({"w": w, "b": b, "hparams": vars(args)}))
        print(f"trial {env.trial_id or 0}: {METRIC}={val_mse:.5f}; metrics in {hypertune.metric_file()}")
        print(f"model written to {model}")


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s")
    main()

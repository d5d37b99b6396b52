"""A Keras classifier on Vertex AI: MultiWorkerMirroredStrategy fed by a vertexrt reader, checkpoints with
exact mid-epoch resume (weights, optimizer and every worker's read position), preemption handling, hypertune
reports, TensorBoard and a multi-worker-safe export, all through vertexrt.

It writes its synthetic data first (next to the job's outputs: local disk, /gcs/ or gs://), trains with
tf-keras (Keras 3 `fit` fails under MultiWorkerMirroredStrategy on TF 2.21), and exports a SavedModel (what
Vertex AI serving loads) to `AIP_MODEL_DIR` (every worker saves, the chief's copy lands). A preempted and
restarted run ends with the same weights as an uninterrupted one (compare the printed `weights_sha256`).

    python examples/keras_classifier.py
    vertexrt local-run --workers 2 -- python examples/keras_classifier.py
    vertexrt local-run --workers 2 --preempt-after 25 --restarts 1 -- python examples/keras_classifier.py
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from vertexrt import hypertune, paths
from vertexrt.checkpoint import CheckpointManager, EveryNSteps, KeepLast
from vertexrt.data import open_dataset
from vertexrt.distributed import setup_tensorflow
from vertexrt.env import environment

FEATURES, CLASSES = 8, 3


def write_data(uri: str, rows: int, seed: int) -> None:
    """Synthetic 3-class data as JSON lines: the class is the argmax of three fixed linear scores."""
    import numpy as np

    scores = np.random.default_rng(0).normal(size=(FEATURES, CLASSES))
    x = np.random.default_rng(seed).normal(size=(rows, FEATURES)).astype("float32")
    y = (x @ scores).argmax(axis=1)
    with paths.open(uri, "w") as f:
        f.writelines(
            json.dumps({"x": row.tolist(), "y": int(label)}) + "\n" for row, label in zip(x, y, strict=True)
        )


def barrier(strategy: object) -> None:
    """Every worker waits here until all arrive (a tiny all-reduce)."""
    import tensorflow as tf

    strategy.reduce(tf.distribute.ReduceOp.SUM, strategy.run(lambda: tf.constant(1)), axis=None)


def hold_at(step: int | None) -> list[object]:
    """Demo only: on a fresh run, wait at global step ``step`` until the preemption notice (SIGTERM) arrives,
    so `vertexrt local-run --preempt-after S` preempts mid-epoch whatever the machine's speed."""
    import tensorflow as tf

    from vertexrt.preemption.signals import preemption_signal

    class HoldAt(tf.keras.callbacks.Callback):  # type: ignore[misc, name-defined]
        def on_train_batch_end(self, batch: int, logs: object = None) -> None:
            if int(self.model.optimizer.iterations.numpy()) != step:
                return
            logging.info("holding at step %d until a preemption notice arrives", step)
            deadline = time.monotonic() + 300
            while not preemption_signal().requested and time.monotonic() < deadline:
                time.sleep(0.1)

    return [] if step is None else [HoldAt()]


def main() -> None:
    parser = argparse.ArgumentParser(description="Keras classifier on vertexrt")
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--steps_per_epoch", type=int, default=40)
    parser.add_argument("--batch_size", type=int, default=64, help="global batch size")
    parser.add_argument("--learning_rate", type=float, default=0.01)
    parser.add_argument("--checkpoint_every", type=int, default=10, help="steps between checkpoints")
    parser.add_argument(
        "--hold_at_step", type=int, default=None, help="demo: wait at this step of a fresh run for a SIGTERM"
    )
    args = hypertune.parse_args(parser, ignore_unknown=True)

    strategy = setup_tensorflow(legacy_keras=True)  # first: before TensorFlow runs any op
    import tensorflow as tf

    from vertexrt import keras as vk

    env = environment()
    base = env.model_dir.rsplit("/", 1)[0]
    train_uri, val_uri = paths.join(base, "data", "train.jsonl"), paths.join(base, "data", "val.jsonl")
    written = paths.join(base, "data", "_SUCCESS")
    fs, marker = paths.filesystem(written)
    if hypertune.is_chief() and not fs.exists(marker):  # once: a saved reader place belongs to these files
        write_data(val_uri, rows=1024, seed=2)  # (a rewrite, even of the same bytes, is refused on resume)
        write_data(train_uri, rows=4096, seed=1)
        with paths.open(written, "w") as f:
            f.write("ok")
    barrier(strategy)  # the other workers read what the chief wrote

    tf.keras.utils.set_random_seed(1)
    with strategy.scope():
        model = tf.keras.Sequential(
            [
                tf.keras.Input((FEATURES,)),
                tf.keras.layers.Dense(32, activation="relu"),
                tf.keras.layers.Dense(CLASSES),
            ]
        )
        model.compile(
            optimizer=tf.keras.optimizers.Adam(args.learning_rate),
            loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=["accuracy"],
        )

    # Each worker reads its own share of the files/records; the callback checkpoints where it is in it.
    reader = open_dataset(train_uri, format="jsonl", seed=2, shuffle_buffer=1024)
    manager = CheckpointManager(
        env.checkpoint_dir, save_policy=EveryNSteps(args.checkpoint_every), keep_policy=KeepLast(2)
    )
    checkpoints = vk.CheckpointCallback(manager, data=reader)
    checkpoints.restore(model)  # weights, optimizer, position and this worker's place in the reader
    train = checkpoints.as_tf(batch_size=args.batch_size).map(lambda b: (b["x"], b["y"]))
    # Validation: small, in memory, every worker evaluates a DATA-sharded part of the same records.
    records = list(open_dataset(val_uri, format="jsonl", shuffle=False, rank=0, world_size=1))
    val = tf.data.Dataset.from_tensor_slices(([r["x"] for r in records], [r["y"] for r in records])).batch(
        args.batch_size
    )
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.DATA
    val = val.with_options(options)

    model.fit(
        train,
        epochs=args.epochs,
        steps_per_epoch=args.steps_per_epoch,
        validation_data=val,
        verbose=2,
        callbacks=[
            *hold_at(args.hold_at_step if checkpoints.position.step == 0 else None),
            checkpoints,
            vk.PreemptionCallback(manager),  # SIGTERM: save, stop, exit 143; the restart resumes here
            vk.HypertuneCallback("val_accuracy"),
            vk.TensorBoard(),  # AIP_TENSORBOARD_LOG_DIR, gs:// included; the chief uploads
        ],
    )
    manager.close()

    loss, accuracy = model.evaluate(val, verbose=0)
    target = vk.export(model)  # every worker saves (MWMS needs it); the chief's copy lands in AIP_MODEL_DIR
    if hypertune.is_chief():
        digest = hashlib.sha256(b"".join(w.tobytes() for w in model.get_weights())).hexdigest()
        print(f"final val_accuracy={accuracy:.4f} val_loss={loss:.4f} weights_sha256={digest}")
        print(f"model exported to {target}")


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    main()

"""A Keras classifier on Vertex AI: MultiWorkerMirroredStrategy, checkpoints with mid-epoch resume,
preemption handling, hypertune reports and TensorBoard, all through vertexrt.

It writes its synthetic data first (next to the job's outputs: local disk, /gcs/ or gs://), trains with
tf-keras (Keras 3 `fit` fails under MultiWorkerMirroredStrategy on TF 2.21), and exports `model.keras` to
`AIP_MODEL_DIR` from the chief.

    python examples/keras_classifier.py
    vertexrt local-run --workers 2 -- python examples/keras_classifier.py
    vertexrt local-run --workers 2 --preempt-after 25 -- python examples/keras_classifier.py --epochs 20
"""

from __future__ import annotations

import argparse
import io
import logging
import os
import tempfile

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from vertexrt import hypertune, paths, tensorboard
from vertexrt.checkpoint import CheckpointManager, EveryNSteps, KeepLast
from vertexrt.distributed import setup_tensorflow
from vertexrt.env import environment

FEATURES, CLASSES = 8, 3


def write_data(uri: str, rows: int, seed: int) -> None:
    """Synthetic 3-class data: the class is the argmax of three fixed linear scores."""
    import numpy as np

    scores = np.random.default_rng(0).normal(size=(FEATURES, CLASSES))
    x = np.random.default_rng(seed).normal(size=(rows, FEATURES)).astype("float32")
    y = (x @ scores).argmax(axis=1).astype("int64")
    buffer = io.BytesIO()
    np.savez(buffer, x=x, y=y)
    with paths.open(uri, "wb") as f:
        f.write(buffer.getvalue())


def read_data(uri: str) -> tuple[object, object]:
    import numpy as np

    with paths.open(uri, "rb") as f:
        data = np.load(io.BytesIO(f.read()))
        return data["x"], data["y"]


def barrier(strategy: object) -> None:
    """Every worker waits here until all arrive (a tiny all-reduce)."""
    import tensorflow as tf

    strategy.reduce(tf.distribute.ReduceOp.SUM, strategy.run(lambda: tf.constant(1)), axis=None)


def main() -> None:
    parser = argparse.ArgumentParser(description="Keras classifier on vertexrt")
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--steps_per_epoch", type=int, default=40)
    parser.add_argument("--batch_size", type=int, default=64, help="global batch size")
    parser.add_argument("--learning_rate", type=float, default=0.01)
    parser.add_argument("--checkpoint_every", type=int, default=10, help="steps between checkpoints")
    args = hypertune.parse_args(parser, ignore_unknown=True)

    strategy = setup_tensorflow(legacy_keras=True)  # first: before TensorFlow runs any op
    import tensorflow as tf

    from vertexrt import keras as vk

    env = environment()
    base = env.model_dir.rsplit("/", 1)[0]
    train_uri, val_uri = paths.join(base, "data", "train.npz"), paths.join(base, "data", "val.npz")
    if hypertune.is_chief():
        write_data(train_uri, rows=4096, seed=1)
        write_data(val_uri, rows=1024, seed=2)
    barrier(strategy)  # the other workers read what the chief wrote

    tf.keras.utils.set_random_seed(1)
    x, y = read_data(train_uri)
    vx, vy = read_data(val_uri)
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.DATA
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

    manager = CheckpointManager(
        env.checkpoint_dir, save_policy=EveryNSteps(args.checkpoint_every), keep_policy=KeepLast(2)
    )
    checkpoints = vk.CheckpointCallback(manager)
    position = checkpoints.restore(model)  # weights, optimizer and position of the newest checkpoint
    # A deterministic stream, skipped to where the checkpoint stopped: resumes mid-epoch exactly.
    train = (
        tf.data.Dataset.from_tensor_slices((x, y))
        .shuffle(4096, seed=2)
        .batch(args.batch_size, drop_remainder=True)
        .repeat()
        .skip(position.step)
        .with_options(options)
    )
    val = tf.data.Dataset.from_tensor_slices((vx, vy)).batch(args.batch_size).with_options(options)

    board = tensorboard.writer()  # gs:// safe; does nothing on workers
    log_epoch = tf.keras.callbacks.LambdaCallback(
        on_epoch_end=lambda epoch, logs: board.scalars(logs, epoch + 1)
    )
    model.fit(
        train,
        epochs=args.epochs,
        steps_per_epoch=args.steps_per_epoch,
        validation_data=val,
        verbose=2,
        callbacks=[
            checkpoints,
            vk.PreemptionCallback(manager),  # SIGTERM: save, stop, exit 143; the restart resumes here
            vk.HypertuneCallback("val_accuracy"),
            log_epoch,
        ],
    )
    manager.close()
    board.close()

    loss, accuracy = model.evaluate(val, verbose=0)
    target = paths.join(env.model_dir, "model.keras")
    with tempfile.TemporaryDirectory() as tmp:
        local = os.path.join(tmp, "model.keras")
        model.save(local)  # every worker: saving reads the mirrored variables collectively
        if hypertune.is_chief():
            with open(local, "rb") as src, paths.open(target, "wb") as dst:
                dst.write(src.read())
    if hypertune.is_chief():
        print(f"final val_accuracy={accuracy:.4f} val_loss={loss:.4f}")
        print(f"model exported to {target}; TensorBoard logs in {board.log_dir}")


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    main()

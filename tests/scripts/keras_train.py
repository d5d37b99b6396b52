"""A Keras training preempted (SIGTERM) after step KILL_AT, or run through (-1), with vertexrt's callbacks:
``keras_train.py CKPT_DIR OUT KILL_AT EPOCHS`` writes what it saw to OUT (json). ``DATA_URI`` set: fed by a
vertexrt reader through ``CheckpointCallback(data=...).as_tf()``. The Keras flavour: ``TF_USE_LEGACY_KERAS``.
"""

import json
import os
import signal
import sys

import numpy as np
import tensorflow as tf

from vertexrt import keras as vk
from vertexrt.checkpoint import CheckpointManager, EveryNSteps

ckpt_dir, out, kill_at, epochs = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
tf.keras.utils.set_random_seed(0)
tf.config.experimental.enable_op_determinism()
rng = np.random.default_rng(0)
x = rng.normal(size=(96, 4)).astype("float32")
y = (x[:, 0] + x[:, 1] > 0).astype("int64")
model = tf.keras.Sequential(
    [tf.keras.Input((4,)), tf.keras.layers.Dense(8, activation="relu"), tf.keras.layers.Dense(2)]
)
model.compile(
    optimizer=tf.keras.optimizers.Adam(0.01),
    loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    metrics=["accuracy"],
)
manager = CheckpointManager(ckpt_dir, save_policy=EveryNSteps(3))
reader = None
if "DATA_URI" in os.environ:  # fed by a vertexrt reader whose place the checkpoint holds
    from vertexrt.data import open_dataset

    reader = open_dataset(os.environ["DATA_URI"], shuffle=True, seed=3, shuffle_buffer=32)
ckpt = vk.CheckpointCallback(manager) if reader is None else vk.CheckpointCallback(manager, data=reader)
position = ckpt.restore(model)
if reader is None:
    # 6 batches per pass over the data, 5 steps per epoch: epochs and passes do not line up
    data = tf.data.Dataset.from_tensor_slices((x, y)).shuffle(96, seed=1).batch(16)
    data = data.repeat().skip(position.step)
else:
    # 100 records per data epoch, 16 per step (6.25 steps), 5 steps per Keras epoch: nothing lines up,
    # and no skip arithmetic
    data = ckpt.as_tf(16).map(lambda b: (b["x"], b["y"]))
seen = []


def on_batch(batch, logs):
    seen.append([int(model.optimizer.iterations.numpy()), batch])
    if int(model.optimizer.iterations.numpy()) == kill_at:
        os.kill(os.getpid(), signal.SIGTERM)


record = tf.keras.callbacks.LambdaCallback(on_train_batch_end=on_batch)
preemption = vk.PreemptionCallback(manager)
try:
    model.fit(
        data,
        epochs=epochs,
        steps_per_epoch=5,
        verbose=0,
        callbacks=[ckpt, preemption, vk.HypertuneCallback("accuracy"), record],
    )
finally:
    with open(out, "w") as f:
        json.dump(
            {
                "position": list(position),
                "seen": seen,
                "preempted": preemption.preempted,
                "iterations": int(model.optimizer.iterations.numpy()),
                "weights": [w.tolist() for w in model.get_weights()],
            },
            f,
        )
manager.close()

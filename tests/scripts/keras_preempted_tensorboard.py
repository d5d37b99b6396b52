"""A Keras fit with vk.TensorBoard preempted mid-epoch (SIGTERM at batch 2), saved by the
PreemptionCallback: ``keras_preempted_tensorboard.py CKPT_DIR LOG_DIR``."""

import signal
import sys

import numpy as np
import tensorflow as tf

from vertexrt import keras as vk
from vertexrt.checkpoint import CheckpointManager


class Notice(tf.keras.callbacks.Callback):
    def on_train_batch_end(self, batch, logs=None):
        if batch == 2:
            signal.raise_signal(signal.SIGTERM)  # the preemption notice, mid-epoch


manager = CheckpointManager(sys.argv[1])
model = tf.keras.Sequential([tf.keras.Input((4,)), tf.keras.layers.Dense(2)])
model.compile("sgd", "mse")
x, y = np.zeros((64, 4), "float32"), np.zeros((64, 2), "float32")
callbacks = [vk.TensorBoard(sys.argv[2]), Notice(), vk.PreemptionCallback(manager)]
model.fit(x, y, batch_size=8, epochs=1, verbose=0, callbacks=callbacks)

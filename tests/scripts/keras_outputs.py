"""vk.TensorBoard and vk.export under a storage root: ``keras_outputs.py ROOT OUT`` writes to OUT (json)
where the model went, every file under ROOT and the TensorBoard scratch directory."""

import json
import sys

import numpy as np
import tensorflow as tf

from vertexrt import keras as vk
from vertexrt import paths

root, out = sys.argv[1], sys.argv[2]
x = np.random.default_rng(0).normal(size=(64, 4)).astype("float32")
y = (x[:, 0] > 0).astype("int64")
model = tf.keras.Sequential([tf.keras.Input((4,)), tf.keras.layers.Dense(2)])
model.compile(optimizer="sgd", loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True))
board = vk.TensorBoard(paths.join(root, "logs"), upload_interval=3600)
model.fit(x, y, batch_size=16, epochs=2, verbose=0, callbacks=[board])
where = vk.export(model, paths.join(root, "model"))
fs, base = paths.filesystem(root)
with open(out, "w") as f:
    json.dump(
        {"where": where, "files": sorted(p[len(base) :] for p in fs.find(base)), "scratch": board.log_dir}, f
    )

"""vk.export of a model whose Lambda closes over modules, under four file names: ``keras_lambda_export.py
ROOT`` prints ``RESULT {json}`` (where each went, its files, whether the SavedModel serves the model's
outputs)."""

import json
import os
import sys

import numpy as np
import tensorflow as tf

from vertexrt import keras as vk


def build():  # the Lambda closes over modules, as `import ...` inside a model builder makes it
    import tensorflow as tfl

    scale = np
    return tf.keras.Sequential(
        [
            tf.keras.Input((4,)),
            tf.keras.layers.Dense(3),
            tf.keras.layers.Lambda(lambda t: tfl.abs(t) * scale.float32(2)),
            tf.keras.layers.Dense(2),
        ]
    )


root = sys.argv[1]
x = np.random.default_rng(0).normal(size=(32, 4)).astype("float32")
model = build()
model.compile(optimizer="sgd", loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True))
model.fit(x, (x[:, 0] > 0).astype("int64"), batch_size=8, epochs=1, verbose=0)
result = {}
names = {"default": None, "named": "savedmodel", "h5": "model.h5", "keras": "model.keras"}
for name, filename in names.items():
    where = vk.export(model, os.path.join(root, name), filename=filename)
    served = None
    if os.path.isfile(os.path.join(where, "saved_model.pb")):
        outputs = tf.saved_model.load(where).signatures["serving_default"](tf.constant(x[:5]))
        served = bool(np.allclose(next(iter(outputs.values())).numpy(), model(x[:5]).numpy()))
    files = sorted(os.listdir(os.path.join(root, name)))
    result[name] = {"where": os.path.relpath(where, root), "files": files, "served": served}
print("RESULT " + json.dumps(result))

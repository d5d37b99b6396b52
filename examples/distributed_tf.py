"""Multi-worker TensorFlow training on Vertex AI, the same code locally.

``setup_tensorflow()`` must run first: it writes TF_CONFIG for this replica and returns the strategy the
cluster needs (MultiWorkerMirrored here). On TF 2.21, Keras 3 ``model.fit`` fails under that strategy, so
this example uses tf-keras (``pip install --no-deps tf-keras==2.21.0``) via ``legacy_keras=True``. Locally:

    vertexrt local-run --workers 2 -- python examples/distributed_tf.py
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from vertexrt.distributed import cluster, setup_tensorflow  # noqa: E402

strategy = setup_tensorflow(legacy_keras=True)  # before any other TensorFlow call

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402


def main() -> None:
    me = cluster()
    x = np.random.RandomState(0).rand(512, 4).astype("float32")
    y = x @ np.array([[1.0], [-2.0], [3.0], [0.5]], dtype="float32")
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.DATA
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).shuffle(512, seed=0).batch(64).with_options(options)
    with strategy.scope():
        model = tf.keras.Sequential([tf.keras.Input((4,)), tf.keras.layers.Dense(1)])
        model.compile(optimizer=tf.keras.optimizers.SGD(0.1), loss="mse")
    history = model.fit(dataset, epochs=5, verbose=0)
    if me.is_chief:
        print(f"{type(strategy).__name__} over {strategy.num_replicas_in_sync} workers")
        print("losses:", [round(v, 4) for v in history.history["loss"]])
        print("weights:", [round(float(w), 2) for w in model.layers[0].kernel.numpy().ravel()])


if __name__ == "__main__":
    main()

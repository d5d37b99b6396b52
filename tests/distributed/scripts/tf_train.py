"""TensorFlow multi-worker checks; one mode per run: ctl, fit_legacy, ps, hang_chief, after_ops."""

import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
mode = sys.argv[1]

from vertexrt.distributed import cluster, setup_tensorflow  # noqa: E402
from vertexrt.errors import ConfigError  # noqa: E402

if mode == "hang_chief":
    if cluster().role != "chief":
        sys.exit(0)  # the chief's peer never comes: it blocks in the strategy constructor
    import logging

    import tensorflow  # noqa: F401  # imported first, so only the strategy constructor remains

    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")  # as under @vertexrt.main

    print("entering the strategy constructor", flush=True)  # it holds the GIL while it waits
    setup_tensorflow(legacy_keras=False)
    sys.exit(3)  # not reached

if mode == "after_ops":
    import tensorflow as tf

    from vertexrt.distributed import Cluster

    tf.constant(1.0) + 1.0
    from vertexrt import devices

    record = {"default": type(setup_tensorflow(cluster=Cluster(source="local"))).__name__}
    record["gpus"] = [len(devices.gpu_inventory()), devices.tf_memory_growth()]  # TF's inventory; no GPU here
    try:
        setup_tensorflow()  # TF_CONFIG names two workers, but ops already ran
    except ConfigError as err:
        record["error"] = str(err)
    tf.keras.layers.Dense  # noqa: B018  # tf.keras is now Keras 3
    try:
        setup_tensorflow(cluster=Cluster(source="local"), legacy_keras=True)
    except ConfigError as err:
        record["keras_error"] = str(err)
    print("RESULT " + json.dumps(record), flush=True)
    sys.exit(0)

if mode == "ps":
    strategy = setup_tensorflow(legacy_keras=False)  # ps and worker tasks serve here and never return
    import tensorflow as tf

    coordinator = tf.distribute.experimental.coordinator.ClusterCoordinator(strategy)
    with strategy.scope():
        counter = tf.Variable(0.0)

    @tf.function
    def increment() -> None:
        counter.assign_add(1.0)

    for _ in range(4):
        coordinator.schedule(increment)
    coordinator.join()
    record = {"strategy": type(strategy).__name__, "value": float(counter.numpy()), "role": cluster().role}
    print("RESULT " + json.dumps(record), flush=True)
    sys.exit(0)

strategy = setup_tensorflow(legacy_keras=True if mode == "fit_legacy" else None)

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

x = np.random.RandomState(cluster().rank).rand(32, 4).astype("float32")  # different data per worker
y = x.sum(axis=1, keepdims=True)
options = tf.data.Options()
options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.DATA
dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(8).with_options(options)

with strategy.scope():
    model = tf.keras.Sequential([tf.keras.Input((4,)), tf.keras.layers.Dense(1)])
    optimizer = tf.keras.optimizers.SGD(0.1)

if mode == "fit_legacy":
    model.compile(optimizer=optimizer, loss="mse")
    model.fit(dataset, epochs=1, verbose=0)
else:

    @tf.function
    def step(batch):
        def replica_step(inputs):
            features, labels = inputs
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean((model(features) - labels) ** 2) / strategy.num_replicas_in_sync
            grads = tape.gradient(loss, model.trainable_variables)
            optimizer.apply_gradients(zip(grads, model.trainable_variables, strict=True))

        strategy.run(replica_step, args=(batch,))

    step(next(iter(strategy.experimental_distribute_dataset(dataset))))

record = {
    "strategy": type(strategy).__name__,
    "is_multi_worker": isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy),
    "replicas": strategy.num_replicas_in_sync,
    "keras": tf.keras.__name__,
    "weights": [w.numpy().ravel().round(6).tolist() for w in model.weights],
    "role": cluster().role,
}
print("RESULT " + json.dumps(record), flush=True)

"""TensorFlow variables and Keras models in the state tree (weights restored in place)."""

from __future__ import annotations

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")
keras = pytest.importorskip("keras")

from vertexrt.checkpoint import CheckpointManager  # noqa: E402


def _model(seed: int):
    keras.utils.set_random_seed(seed)
    model = keras.Sequential(
        [keras.Input((4,)), keras.layers.Dense(8, activation="relu"), keras.layers.Dense(1)]
    )
    model.compile(optimizer="adam", loss="mse")
    return model


def test_keras_model_tf_variables_and_tensors(storage_root):
    model = _model(1)
    x, y = np.random.default_rng(0).normal(size=(32, 4)), np.random.default_rng(1).normal(size=(32, 1))
    model.fit(x, y, epochs=1, verbose=0)
    counter = tf.Variable(41, dtype=tf.int64)
    half = tf.Variable(tf.ones((2, 2), dtype=tf.bfloat16))
    state = {
        "model": model,
        "opt": list(model.optimizer.variables),
        "counter": counter,
        "half": half,
        "const": tf.constant([1.5, 2.5]),
    }
    with CheckpointManager(storage_root, async_save=False) as mgr:
        mgr.save(1, state)
        plain = mgr.restore()
        fresh = _model(2)
        fresh.optimizer.build(fresh.trainable_variables)
        target = {
            "model": fresh,
            "opt": list(fresh.optimizer.variables),
            "counter": tf.Variable(0, dtype=tf.int64),
            "half": tf.Variable(tf.zeros((2, 2), dtype=tf.bfloat16)),
            "const": None,
        }
        out = mgr.restore(target=target)
    assert out["model"] is fresh
    for a, b in zip(fresh.get_weights(), model.get_weights(), strict=True):
        np.testing.assert_array_equal(a, b)
    for a, b in zip(fresh.optimizer.variables, model.optimizer.variables, strict=True):
        np.testing.assert_array_equal(a.numpy(), b.numpy())
    np.testing.assert_allclose(fresh.predict(x, verbose=0), model.predict(x, verbose=0))
    assert int(target["counter"].numpy()) == 41
    assert target["half"].dtype == tf.bfloat16 and float(target["half"].numpy()[0, 0]) == 1.0
    np.testing.assert_array_equal(out["const"], np.array([1.5, 2.5], np.float32))
    assert isinstance(plain["model"], list) and len(plain["model"]) == len(model.get_weights())
    assert plain["half"].dtype.name == "bfloat16"

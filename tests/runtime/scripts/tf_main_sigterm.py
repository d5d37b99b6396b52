"""@vertexrt.main(framework="tf") with MultiWorkerMirroredStrategy: a SIGTERM raised inside the function is
seen on this rank (TensorFlow's multi-worker runtime takes SIGTERM at the C level when it starts), the rank
saves and the job exits 143."""

import json
import os
import signal

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import vertexrt  # noqa: E402


@vertexrt.main(framework="tf", legacy_keras=False)
def train(ctx: vertexrt.Context) -> None:
    import tensorflow as tf

    with ctx.strategy.scope():
        weight = tf.Variable(2.0)
    signal.raise_signal(signal.SIGTERM)  # handled in this thread before raise_signal returns
    stop = ctx.should_stop()
    if stop:
        ctx.checkpoints.save(1, {"weight": weight.numpy()}, force=True)
        ctx.checkpoints.wait()
    print(
        "RESULT "
        + json.dumps({"rank": ctx.rank, "stop": stop, "replicas": ctx.strategy.num_replicas_in_sync})
    )


train()

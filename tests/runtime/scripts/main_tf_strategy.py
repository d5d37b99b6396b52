"""@main(framework="tf"): the strategy exists before the training function runs; prints it and the device."""

from vertexrt.runtime import main


@main(framework="tf")
def train(ctx):
    import tensorflow as tf

    assert isinstance(ctx.strategy, tf.distribute.Strategy), ctx.strategy
    print("strategy", type(ctx.strategy).__name__, ctx.device)


train()

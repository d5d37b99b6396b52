"""A training loop that never calls ctx.should_stop(): prints ``ready``, then runs on through SIGTERM until
vertexrt's prompt warning about it was logged."""

import logging
import threading
import time

from vertexrt.preemption.signals import preemption_signal
from vertexrt.runtime import main

warned = threading.Event()


class Seen(logging.Handler):
    def emit(self, record):
        if "has not checked" in record.getMessage() or "ago and" in record.getMessage():
            warned.set()


@main
def train(ctx):
    logging.getLogger("vertexrt").addHandler(Seen())
    print("ready", flush=True)
    deadline = time.monotonic() + 60
    while not preemption_signal().requested and time.monotonic() < deadline:  # not a poll
        time.sleep(0.01)  # a training loop that never calls ctx.should_stop()
    warned.wait(60)  # the prompt warning, while the loop runs on
    return "finished"


train()

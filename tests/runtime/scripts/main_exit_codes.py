"""@main's exit codes in a real process: ``main_exit_codes.py ok|fail|preempt`` (0, the user's error: 1,
preempted: 143)."""

import os
import signal
import sys

from vertexrt.runtime import main


@main
def train(ctx):
    if sys.argv[1] == "fail":
        raise RuntimeError("bad batch")
    if sys.argv[1] == "preempt":
        os.kill(os.getpid(), signal.SIGTERM)
        ctx.should_stop()


train()

"""Under ``@main``: completes steps 1..3, then waits forever; the hang watchdog (``VERTEXRT_HANG_TIMEOUT``)
ends it."""

import threading

import vertexrt


@vertexrt.main(preflight=False)
def train(ctx: vertexrt.Context) -> None:
    for step in range(1, 4):
        ctx.step(step)
    threading.Event().wait()


if __name__ == "__main__":
    train()

"""A plain loop under @vertexrt.main reporting each step with ctx.step(); its fourth step never ends: the
process watchdog must end the replica."""

import threading

import vertexrt


def train_step(step: int) -> None:
    if step == 3:
        threading.Event().wait()  # stuck_in_step


@vertexrt.main(preflight=False)
def train(ctx: vertexrt.Context) -> None:
    for step in range(1, 10):
        train_step(step)
        ctx.step(step)
    print("FINISHED", flush=True)


if __name__ == "__main__":
    train()

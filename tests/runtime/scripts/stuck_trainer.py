"""A Trainer under @vertexrt.main whose fourth step never ends: the process watchdog must end the replica."""

import threading

import vertexrt


class Stuck(vertexrt.Trainer):
    def setup(self) -> None:
        self.train_data = list(range(10))

    def train_step(self, batch: int) -> dict[str, float]:
        if batch == 3:
            threading.Event().wait()  # stuck_in_step
        return {"loss": 0.0}

    def export(self, model_dir: str) -> None:
        print("FINISHED", flush=True)


@vertexrt.main(preflight=False)
def train(ctx: vertexrt.Context) -> None:
    Stuck(ctx, max_epochs=1).fit()


if __name__ == "__main__":
    train()

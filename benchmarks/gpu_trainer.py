"""Steps/s of ``vertexrt.Trainer.fit()`` against a plain loop on one GPU (the per-step syncs it must not add).

One process, world of 1, an MLP + AdamW on ``cuda``. Each size runs the plain loop and ``Trainer.fit()``
alternately ``--repeats`` times (which goes first alternates too); a run's rate is timed from its 20th step
to its last one, with ``torch.cuda.synchronize()`` at both ends (the Trainer's restore, final checkpoint and
export are outside the window). A Trainer that waited for the GPU every step (``.item()``, a pageable
host-to-device copy) would keep the host from running ahead and fall behind the plain loop on small models.

Run (GPU machine): PYTHONPATH=src python3 benchmarks/gpu_trainer.py [--steps 600] [--repeats 3] [--sizes 0,1]
"""

from __future__ import annotations

import argparse
import logging
import statistics
import tempfile
import time
from typing import Any

SIZES = [(4, 512, 64), (8, 1024, 256), (8, 4096, 1024)]  # (layers, width, batch)
WARMUP = 20


def build(layers: int, width: int) -> tuple[Any, Any]:
    import torch

    torch.manual_seed(0)
    blocks: list[Any] = []
    for _ in range(layers):
        blocks += [torch.nn.Linear(width, width), torch.nn.ReLU()]
    model = torch.nn.Sequential(*blocks).cuda()
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4)


class Clock:
    """Wall time from the WARMUP-th step to the last, with the GPU drained at both ends."""

    def __init__(self, steps: int) -> None:
        self.steps, self.seen, self.began, self.ended = steps, 0, 0.0, 0.0

    def tick(self) -> None:
        import torch

        self.seen += 1
        if self.seen == WARMUP:
            torch.cuda.synchronize()
            self.began = time.perf_counter()
        elif self.seen == self.steps:
            torch.cuda.synchronize()
            self.ended = time.perf_counter()

    def rate(self) -> float:
        return (self.steps - WARMUP) / (self.ended - self.began)


def step_fn(model: Any, opt: Any, batch: Any) -> Any:
    loss = model(batch).square().mean()
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()
    return loss


def plain(layers: int, width: int, batch_rows: int, steps: int) -> float:
    import torch

    model, opt = build(layers, width)
    data = torch.randn(batch_rows, width, device="cuda")
    clock = Clock(steps)
    for _ in range(steps):
        step_fn(model, opt, data)
        clock.tick()
    return clock.rate()


def trainer(layers: int, width: int, batch_rows: int, steps: int, root: str) -> float:
    import torch

    from vertexrt.checkpoint import CheckpointManager, EveryNSeconds
    from vertexrt.runtime import Context, Trainer

    clock = Clock(steps)
    data = torch.randn(batch_rows, width, device="cuda")

    class Bench(Trainer):
        def setup(self) -> None:
            self.model, self.optimizer = build(layers, width)
            self.train_data = [data] * steps

        def train_step(self, batch: Any) -> dict[str, Any]:
            loss = step_fn(self.model, self.optimizer, batch)
            clock.tick()
            return {"loss": loss}  # a CUDA tensor: read only at progress lines

    ctx = Context.create(rank=0, world_size=1, local_rank=0)
    ctx.metrics.hypertune = False
    ctx.checkpoints = CheckpointManager(tempfile.mkdtemp(dir=root), save_policy=EveryNSeconds(600))
    try:
        Bench(ctx, max_epochs=1, progress_interval=5.0, progress_bar=False, tensorboard=False).fit()
    finally:
        ctx.close()
    return clock.rate()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--sizes", default="0,1,2", help=f"indices into {SIZES} (layers, width, batch)")
    args = parser.parse_args()
    import torch

    logging.disable(logging.WARNING)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; steps/s, median of {args.repeats}")
    print("| model | plain loop (min-max) | Trainer.fit() (min-max) | ratio |\n|---|---|---|---|")
    with tempfile.TemporaryDirectory(prefix="vertexrt-gpu-trainer-") as root:
        for layers, width, rows in [SIZES[int(i)] for i in args.sizes.split(",")]:
            plain(layers, width, rows, WARMUP + 10)  # kernels, allocator
            runs: dict[str, list[float]] = {"plain": [], "trainer": []}
            for i in range(args.repeats):
                order = ["plain", "trainer"] if i % 2 == 0 else ["trainer", "plain"]
                for kind in order:
                    if kind == "plain":
                        runs[kind].append(plain(layers, width, rows, args.steps))
                    else:
                        runs[kind].append(trainer(layers, width, rows, args.steps, root))
            p, t = (runs[k] for k in ("plain", "trainer"))
            mp, mt = statistics.median(p), statistics.median(t)
            print(
                f"| MLP {layers}x{width}, batch {rows} | {mp:.0f} ({min(p):.0f}-{max(p):.0f})"
                f" | {mt:.0f} ({min(t):.0f}-{max(t):.0f}) | {mt / mp:.2f}x |"
            )


if __name__ == "__main__":
    main()

"""Train a small PyTorch classifier with ``vertexrt.Trainer``: resumable, preemption-safe, distributed.

It runs as it would on Vertex AI, and the same way on this machine:

    python examples/torch_classifier.py                                  # one process
    vertexrt local-run --workers 2 -- python examples/torch_classifier.py
    vertexrt local-run --workers 2 --preempt-after 15 -- python examples/torch_classifier.py --hold-at-step 20
    torchrun --standalone --nproc_per_node 2 examples/torch_classifier.py
    vertexrt local-run --workers 2 -- python examples/torch_classifier.py --fsdp     # FSDP2 instead of DDP

Data: unless ``--data`` or ``AIP_TRAINING_DATA_URI`` names real data, the chief first writes synthetic
3-class data (4 JSONL shards, or TFRecord ``tf.train.Example`` shards with ``--format tfrecord``, plus a
validation file) next to the job's output directories, the local directory or bucket that stands in for
Cloud Storage. Every rank reads its shard through ``vertexrt.data`` (shuffled, equal batch counts).

The Trainer restores the newest checkpoint in ``AIP_CHECKPOINT_DIR`` (weights, optimizer, LR schedule, step,
epoch, each rank's RNG and read position), wraps the model in DistributedDataParallel when there are several
replicas, evaluates every epoch (the metrics of the ranks are averaged, weighted by the examples each
scored: here each rank scores the whole validation file) and reports ``accuracy`` to hypertune, saves every
``--checkpoint-every`` steps and on SIGTERM (then exits 143 so the job restarts), and the chief exports
``model.pt`` (a ``state_dict``) and ``model.json`` to ``AIP_MODEL_DIR``.

Load the exported model:

    net = build_model(); net.load_state_dict(torch.load(io.BytesIO(paths.open(uri, "rb").read())))
"""

from __future__ import annotations

import argparse
import io
import json
import logging
import os
import random
import time
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

import vertexrt
import vertexrt.data
import vertexrt.data.torch
from vertexrt import paths
from vertexrt.checkpoint import CheckpointManager, EveryNSteps, KeepLast

logger = logging.getLogger(__name__)  # "__main__" as a script: @main logs it at INFO

FEATURES, CLASSES, HIDDEN = 8, 3, 32
TRAIN_SHARDS = 4


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--records", type=int, default=1024, help="synthetic training records")
    parser.add_argument("--format", choices=("jsonl", "tfrecord"), default="jsonl")
    parser.add_argument("--data", default=None, help="training data URI (default: AIP_TRAINING_DATA_URI)")
    parser.add_argument("--val-data", default=None, help="validation data URI")
    parser.add_argument("--checkpoint-every", type=int, default=20, help="steps between checkpoints")
    parser.add_argument("--log-every", type=float, default=5.0, help="seconds between progress lines")
    parser.add_argument(
        "--fsdp",
        action="store_true",
        help="shard the model's layers with FSDP2 (fully_shard) instead of DistributedDataParallel",
    )
    parser.add_argument(
        "--record-log", default=None, help="directory: each rank logs the record ids it trains on"
    )
    parser.add_argument(
        "--hold-at-step",
        type=int,
        default=None,
        help="demo: on a fresh start, wait at this step (up to 120 s) until a preemption notice arrives",
    )
    return parser


def build_model() -> torch.nn.Module:
    return torch.nn.Sequential(
        torch.nn.Linear(FEATURES, HIDDEN), torch.nn.ReLU(), torch.nn.Linear(HIDDEN, CLASSES)
    )


def shard(model: torch.nn.Module, ctx: vertexrt.Context) -> None:
    """FSDP2: each layer's parameters, then the root's, sharded over the ranks. The Trainer sees the
    DTensors: it does not wrap the model in DDP, and every rank checkpoints its own shards (through
    torch.distributed.checkpoint)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(ctx.device.type, (ctx.world_size,))
    for layer in model.children():
        if any(p.requires_grad for p in layer.parameters()):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)


def full_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The unsharded ``state_dict`` of an FSDP2 model, on the chief (a collective: every rank calls it)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


# ---- synthetic data, written once by the chief ---------------------------------------------------


def data_locations(ctx: vertexrt.Context, args: argparse.Namespace) -> tuple[str, str, Any]:
    """Training URI, validation URI and the format to read them with; writes synthetic data if needed."""
    fmt: Any = vertexrt.data.TFRecord(example=True) if args.format == "tfrecord" else "jsonl"
    train, val = args.data or ctx.env.training_data_uri, args.val_data or ctx.env.validation_data_uri
    if train and val:
        return train, val, None  # real data: the format comes from AIP_DATA_FORMAT or the file names
    root = paths.join(ctx.env.model_dir.rsplit("/", 1)[0], "data")
    ext = "tfrecord" if args.format == "tfrecord" else "jsonl"
    if ctx.is_chief and not _exists(paths.join(root, f"_SUCCESS.{ext}")):
        write_synthetic(root, ext, args.records, args.seed)
    if dist.is_initialized():
        dist.barrier()  # the other ranks read what the chief wrote
    return paths.join(root, f"train-*.{ext}"), paths.join(root, f"validation.{ext}"), fmt


def write_synthetic(root: str, ext: str, records: int, seed: int) -> None:
    rng = random.Random(seed)
    centers = [[rng.gauss(0.0, 1.5) for _ in range(FEATURES)] for _ in range(CLASSES)]

    def record(i: int) -> dict[str, Any]:
        label = rng.randrange(CLASSES)
        x = [round(c + rng.gauss(0.0, 1.5), 4) for c in centers[label]]
        return {"id": i, "x": x, "y": label}

    shards = [list(range(s, records, TRAIN_SHARDS)) for s in range(TRAIN_SHARDS)]
    files = {
        f"train-{s:05d}-of-{TRAIN_SHARDS:05d}.{ext}": [record(i) for i in ids] for s, ids in enumerate(shards)
    }
    files[f"validation.{ext}"] = [record(records + i) for i in range(max(records // 4, 1))]
    for name, rows in files.items():
        _write_rows(paths.join(root, name), ext, rows)
    with paths.open(paths.join(root, f"_SUCCESS.{ext}"), "w") as f:
        f.write(json.dumps({"files": sorted(files), "records": records, "seed": seed}))
    logger.info("wrote %d synthetic training records in %d shards to %s", records, TRAIN_SHARDS, root)


def _write_rows(uri: str, ext: str, rows: list[dict[str, Any]]) -> None:
    if ext == "jsonl":
        with paths.open(uri, "w") as f:
            f.write("".join(json.dumps(row) + "\n" for row in rows))
        return
    with vertexrt.data.TFRecordWriter(uri) as writer:
        for row in rows:
            writer.write(vertexrt.data.encode_example({"id": [row["id"]], "x": row["x"], "y": [row["y"]]}))


def _exists(uri: str) -> bool:
    fs, path = paths.filesystem(uri)
    return bool(fs.exists(path))


def collate(records: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
    """JSONL records ({"y": 2}) and decoded Examples ({"y": [2]}) into tensors."""

    def scalar(value: Any) -> Any:
        return value[0] if isinstance(value, list) else value

    return {
        "id": torch.tensor([scalar(r["id"]) for r in records], dtype=torch.int64),
        "x": torch.tensor([r["x"] for r in records], dtype=torch.float32),
        "y": torch.tensor([scalar(r["y"]) for r in records], dtype=torch.int64),
    }


# ---- the trainer ---------------------------------------------------------------------------------


class Classifier(vertexrt.Trainer):
    def __init__(self, ctx: vertexrt.Context, args: argparse.Namespace) -> None:
        manager = CheckpointManager(
            ctx.env.checkpoint_dir, save_policy=EveryNSteps(args.checkpoint_every), keep_policy=KeepLast(2)
        )
        super().__init__(ctx, max_epochs=args.epochs, checkpoints=manager, progress_interval=args.log_every)
        self.args = args

    def setup(self) -> None:
        args, ctx = self.args, self.ctx
        train_uri, val_uri, fmt = data_locations(ctx, args)
        torch.manual_seed(args.seed)
        # A bare module: with several replicas fit() wraps it in DistributedDataParallel (Trainer(ddp=False)
        # opts out); checkpoints and export() see the bare module.
        self.model = build_model().to(ctx.device)
        if args.fsdp:
            shard(self.model, ctx)
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=args.lr, momentum=0.9)
        self.scheduler = torch.optim.lr_scheduler.StepLR(self.optimizer, step_size=40, gamma=0.5)
        train = vertexrt.data.open_dataset(
            train_uri,
            fmt,
            seed=args.seed,
            shuffle_buffer=256,
            equalize="drop_remainder",  # the same number of batches on every rank, as DDP needs
            batch_size=args.batch_size,
        )
        # vertexrt's DataLoader keeps an exact read position (with any num_workers): resume mid-epoch.
        self.train_data = vertexrt.data.torch.DataLoader(
            train, batch_size=args.batch_size, collate_fn=collate
        )
        val = vertexrt.data.open_dataset(val_uri, fmt, shuffle=False, rank=0, world_size=1)
        self.val_data = DataLoader(val.as_torch(), batch_size=256, collate_fn=collate)
        self._record_log = None
        if args.record_log:
            os.makedirs(args.record_log, exist_ok=True)
            self._record_log = open(os.path.join(args.record_log, f"rank{ctx.rank}.txt"), "a")  # noqa: SIM115

    def train_step(self, batch: dict[str, torch.Tensor]) -> dict[str, Any]:
        x, y = batch["x"].to(self.ctx.device), batch["y"].to(self.ctx.device)
        loss = torch.nn.functional.cross_entropy(self.model(x), y)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        self.optimizer.step()
        self.scheduler.step()
        if self._record_log is not None:
            self._record_log.write(f"{self.step + 1} {' '.join(map(str, batch['id'].tolist()))}\n")
            self._record_log.flush()
        if self.args.hold_at_step == self.step + 1 and self.checkpoints.restored_step is None:
            self._hold()
        return {"loss": loss.detach()}

    def _hold(self) -> None:
        logger.info("holding at step %d until a preemption notice arrives", self.step + 1)
        deadline = time.monotonic() + 120
        while not self.should_stop() and time.monotonic() < deadline:
            time.sleep(0.05)

    def evaluate(self) -> dict[str, float]:
        model = self.model
        model.eval()
        correct = total = 0
        loss_sum = 0.0
        with torch.no_grad():
            for batch in self.interruptible(self.val_data):
                logits = model(batch["x"].to(self.ctx.device))
                y = batch["y"].to(self.ctx.device)
                loss_sum += float(torch.nn.functional.cross_entropy(logits, y, reduction="sum"))
                correct += int((logits.argmax(dim=1) == y).sum())
                total += len(y)
        model.train()
        return {"accuracy": (correct / total, total), "val_loss": (loss_sum / total, total)}

    def export(self, model_dir: str) -> None:
        if not self.args.fsdp:  # a sharded model is gathered by every rank after fit(): see main()
            save_state_dict(self.model.state_dict(), model_dir)  # the bare module, also after DDP wrapping
        shape = {"features": FEATURES, "hidden": HIDDEN, "classes": CLASSES, "trained_steps": self.step}
        with paths.open(paths.join(model_dir, "model.json"), "w") as f:
            f.write(json.dumps(shape))


def save_state_dict(state: dict[str, torch.Tensor], model_dir: str) -> None:
    buffer = io.BytesIO()
    torch.save(state, buffer)
    with paths.open(paths.join(model_dir, "model.pt"), "wb") as f:
        f.write(buffer.getvalue())


@vertexrt.main(framework="torch", parser=build_parser())
def main(ctx: vertexrt.Context, args: argparse.Namespace) -> None:
    trainer = Classifier(ctx, args)
    metrics = trainer.fit()
    if args.fsdp:  # export() runs on the chief only; gathering the shards needs every rank
        state = full_state_dict(trainer.model)
        if ctx.is_chief:
            save_state_dict(state, ctx.env.model_dir)
    if ctx.is_chief:
        shown = " ".join(f"{name}={value:.4f}" for name, value in metrics.items())
        logger.info("final %s; model exported to %s", shown, paths.join(ctx.env.model_dir, "model.pt"))


if __name__ == "__main__":
    main()

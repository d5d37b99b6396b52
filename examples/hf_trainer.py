"""A Hugging Face ``Trainer`` on Vertex AI: DDP over the job's replicas, preemption-safe, resumable.

The three vertexrt lines: ``VertexTrainerCallback()``, ``TrainingArguments(**vertex.training_arguments(...))``
+ ``callbacks=[vertex]``, and ``resume_from_checkpoint=vertex.resume_from_checkpoint()``. A tiny GPT-2 is
built from a config (nothing is downloaded). Try it as a preempted 2-replica job:

    vertexrt local-run --workers 2 --preempt-after 30 -- python examples/hf_trainer.py
"""

from __future__ import annotations

import argparse
import os
import time
from typing import Any

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

from vertexrt import paths
from vertexrt.env import environment
from vertexrt.integrations.huggingface import VertexTrainerCallback
from vertexrt.preemption.signals import preemption_signal

VOCAB, LENGTH, SAMPLES = 64, 16, 256


class Sequences(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    """Deterministic token sequences: each continues a random start by a fixed rule (learnable)."""

    def __init__(self, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        start = torch.randint(0, VOCAB, (SAMPLES, 1), generator=g)
        self.ids = (start + 3 * torch.arange(LENGTH)) % VOCAB

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


class HoldAt(TrainerCallback):
    """Demo: the first attempt waits at ``step`` for the preemption notice (as a slow step would)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if state.global_step != self.step:
            return
        print(f"holding at step {self.step}", flush=True)
        deadline = time.monotonic() + 120
        while not preemption_signal().requested and time.monotonic() < deadline:
            time.sleep(0.05)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--save-steps", type=int, default=10)
    parser.add_argument("--hold-at-step", type=int, default=-1, help="first attempt waits there for SIGTERM")
    args = parser.parse_args()

    vertex = VertexTrainerCallback()
    training_args = TrainingArguments(
        **vertex.training_arguments(
            num_train_epochs=args.epochs,
            per_device_train_batch_size=8,
            per_device_eval_batch_size=32,
            learning_rate=1e-3,
            save_steps=args.save_steps,
            save_total_limit=2,
            eval_strategy="epoch",
            metric_for_best_model="loss",
            seed=0,
            data_seed=0,
            dataloader_num_workers=0,
            ddp_find_unused_parameters=False,
            logging_steps=10,
            report_to="none",
            disable_tqdm=True,
        )
    )
    resume = vertex.resume_from_checkpoint()
    print(f"rank {training_args.process_index}: {'resuming from ' + resume if resume else 'fresh start'}")
    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=VOCAB, n_positions=LENGTH, n_embd=32, n_layer=2, n_head=2, bos_token_id=0, eos_token_id=0
    )
    model = GPT2LMHeadModel(config)
    callbacks: list[TrainerCallback] = [vertex]
    if resume is None and args.hold_at_step >= 0:
        callbacks.insert(0, HoldAt(args.hold_at_step))
    trainer = Trainer(
        model=model,
        args=training_args,
        train_dataset=Sequences(0),
        eval_dataset=Sequences(1),
        callbacks=callbacks,
    )
    trainer.train(resume_from_checkpoint=resume)
    if trainer.is_world_process_zero():
        out = paths.join(environment().model_dir, "model.pt")
        with paths.open(out, "wb") as f:
            torch.save(trainer.model.state_dict(), f)
        print(f"done: {trainer.state.global_step} steps, model in {out}", flush=True)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()

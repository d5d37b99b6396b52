"""Trainer + FSDP2 (DTensor) on real gloo ranks: bit-exact resume, and restore onto 3 and 1 ranks."""

from __future__ import annotations

import json
import os

import pytest

from .ckpt_helpers import assert_every_rank_ok, assert_same_tree, run_ranks

torch = pytest.importorskip("torch")


def _fit(world: int, out: str, *plan: str) -> list[str]:
    """Run ``trainer_fsdp_worker.py`` as ``world`` real processes; every one must print OK. Their logs."""

    def argv(rank: int, port: int) -> list[str]:
        return [str(rank), str(world), str(port), out, *plan]

    return assert_every_rank_ok(run_ranks("trainer_fsdp_worker.py", world, argv), str(plan))


def _state(out, tag):
    return torch.load(os.path.join(out, f"{tag}.pt"), weights_only=True)


def _rank(out, tag, rank):
    with open(os.path.join(out, f"{tag}.rank{rank}.json")) as f:
        return json.load(f)


@pytest.mark.slow
def test_fsdp_trainer_resumed_mid_epoch_continues_bit_exactly(tmp_path):
    out = str(tmp_path)
    logs = _fit(2, out, "straight:straight:6", "first:resumed:3", "resumed:resumed:6")
    assert "(step 3)" in logs[0]  # the warning that an earlier run's checkpoint is resumed
    # model and Adam state, bit for bit
    assert_same_tree(_state(out, "straight"), _state(out, "resumed"), "state")
    for rank in (0, 1):
        straight, first, resumed = (_rank(out, tag, rank) for tag in ("straight", "first", "resumed"))
        assert resumed["step"] == 6 and len(first["seen"]) == 3
        assert resumed["seen"] == straight["seen"]  # the per-rank read position and attribute came back
        assert resumed["draw"] == straight["draw"]  # and the per-rank RNG
    assert _rank(out, "straight", 0)["seen"] != _rank(out, "straight", 1)["seen"]


@pytest.mark.slow
def test_fsdp_trainer_checkpoint_restores_onto_three_and_one_ranks(tmp_path):
    out = str(tmp_path)
    _fit(2, out, "saved:ckpt:3")
    logs = _fit(1, out, "on1:ckpt:3")  # restores step 3, which is max_steps: no training
    assert_same_tree(_state(out, "saved"), _state(out, "on1"), "on 1 rank")
    assert "saved by 2 ranks" in logs[0] and "read position" in logs[0], logs[0][-3000:]
    logs = _fit(3, out, "on3:ckpt:3", "more3:ckpt:4")  # and again, training one more step on 3 ranks
    assert_same_tree(_state(out, "saved"), _state(out, "on3"), "on 3 ranks")
    assert "saved by 2 ranks" in logs[0] and "read position" in logs[0], logs[0][-3000:]
    for rank in range(3):
        assert _rank(out, "on3", rank)["step"] == 3
        more = _rank(out, "more3", rank)
        assert more["step"] == 4 and more["seen"] == [30 + rank]  # replayed the epoch, skipped 3 batches


def _errors(out, tag, world):
    errors = []
    for rank in range(world):
        with open(os.path.join(out, f"{tag}.rank{rank}.error")) as f:
            errors.append(f.read())
    return errors


@pytest.mark.slow
@pytest.mark.parametrize("read", ["metadata", "files"])
def test_a_read_failing_on_one_rank_is_the_same_error_on_every_rank_not_a_hang(tmp_path, read):
    """The manifest read (before DCP) or the check of the data files fails on rank 0, the one rank that
    reads them (the others are sent its answer): both ranks must raise the same CheckpointError naming the
    step and rank 0's error (the old code hung until the process group timed out)."""
    rank = 0
    out = str(tmp_path)
    _fit(2, out, "saved:ckpt:3", f"failed:ckpt:5:{read}@{rank}")
    errors = _errors(out, "failed", 2)
    assert errors[0] == errors[1], errors
    assert errors[0].startswith("CheckpointError: restoring checkpoint step 3"), errors
    assert f"503 reading the {read} on rank {rank}" in errors[0] and f"rank {rank}" in errors[0], errors


@pytest.mark.slow
def test_plain_trainable_parameters_beside_dtensors_are_a_config_error_not_silent_divergence(tmp_path):
    """FSDP2 on the Linears only (a plain LayerNorm, no root fully_shard), and tensor parallel Linears with a
    LayerNorm outside the plan: nothing would average the LayerNorm's gradients, so replicas would diverge."""
    out = str(tmp_path)
    _fit(2, out, "fsdp:a:1:partial_fsdp", "tp:b:1:partial_tp")
    for tag, param, fix in (
        ("fsdp", "self.model.1.weight", "fully_shard(self.model)"),
        ("tp", "self.model.0.weight", "Replicate()"),
    ):
        errors = _errors(out, tag, 2)
        assert errors[0] == errors[1] and errors[0].startswith("ConfigError: "), errors
        assert param in errors[0] and fix in errors[0], errors


@pytest.mark.slow
def test_a_step_damaged_on_one_rank_falls_back_to_the_same_older_step_on_every_rank(tmp_path):
    """Step 5's manifest reads as damaged on rank 0 (the rank that reads it): both ranks resume step 3 and
    train to 4."""
    out = str(tmp_path)
    _fit(2, out, "s3:ckpt:3", "s5:ckpt:5", "fell:ckpt:4:damaged@0")
    assert _errors(out, "fell", 2) == ["none", "none"]
    assert [_rank(out, "fell", rank)["step"] for rank in (0, 1)] == [4, 4]  # not 5: step 3 was restored

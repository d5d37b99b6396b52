"""Sharded (FSDP2 / DTensor) checkpoints: 2 gloo ranks save, 3 ranks and 1 rank restore, bit-exact."""

from __future__ import annotations

import os

import pytest

from .ckpt_helpers import assert_every_rank_ok, run_ranks


def _ranks(mode: str, world: int, root: str, out: str, *extra: str) -> None:
    """Run ``dtensor_worker.py`` as ``world`` real processes; every one must print OK."""

    def argv(rank: int, port: int) -> list[str]:
        return [mode, str(rank), str(world), str(port), root, out, *extra]

    assert_every_rank_ok(run_ranks("dtensor_worker.py", world, argv), mode)


@pytest.mark.slow
def test_two_ranks_save_three_and_one_restore_bit_exact(storage_root, tmp_path):
    _ranks("save", 2, storage_root, str(tmp_path))
    _ranks("restore", 3, storage_root, str(tmp_path), "2")
    _ranks("restore", 1, storage_root, str(tmp_path), "2")


@pytest.mark.slow
def test_corrupt_shard_falls_back_on_every_rank(tmp_path):
    root = str(tmp_path / "ckpt")
    _ranks("save", 2, root, str(tmp_path))
    step_dir = os.path.join(root, "step_0000000002")
    victim = sorted(n for n in os.listdir(step_dir) if n.startswith("data.") and ".s1." in n)[0]
    with open(os.path.join(step_dir, victim), "r+b") as f:
        byte = f.read(1)
        f.seek(0)
        f.write(bytes([byte[0] ^ 0xFF]))
    _ranks("restore", 3, root, str(tmp_path), "1")  # every rank agrees on step 1
    _ranks("restore", 1, root, str(tmp_path), "1")


@pytest.mark.slow
def test_dtensor_state_without_process_group_is_a_clear_error(tmp_path):
    _ranks("nogroup", 1, str(tmp_path / "ckpt"), str(tmp_path))


@pytest.mark.slow
def test_bf16_fp8_complex_and_conjugated_dtensors_round_trip_onto_other_world_sizes(tmp_path):
    root = str(tmp_path / "ckpt")
    _ranks("dtypes", 2, root, str(tmp_path))
    _ranks("dtypes_restore", 3, root, str(tmp_path))
    _ranks("dtypes_restore", 1, root, str(tmp_path))

"""Sharded (FSDP2 / DTensor) checkpoints: 2 gloo ranks save, 3 ranks and 1 rank restore, bit-exact."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

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


def _tamper(dcp: dict[str, Any], how: str) -> None:
    """Change the DCP metadata of a manifest (2 ranks: each tensor in two row chunks) the way ``how`` says."""
    entries, storage = dcp["entries"], dcp["storage"]

    def item(fqn: str, offset: list[int]) -> list[Any]:  # [fqn, offset, where] of one stored chunk
        return next(found for found in storage if found[0] == fqn and found[1] == offset)

    if how == "offset_outside":  # rows 16..31 of a 32-row tensor claimed at rows 40..55, consistently
        entries["model.0.weight"]["chunks"][1][0] = [40, 0]
        item("model.0.weight", [16, 0])[1] = [40, 0]
    elif how == "shrunk":  # every chunk 1x1: only one value of each would be copied
        for chunk in entries["model.2.weight"]["chunks"]:
            chunk[1] = [1, 1]
    elif how == "dtype":  # float32 bytes read as int32 (same size, so the byte count still agrees)
        item("model.0.bias", [0])[2]["dtype"] = "int32"
    elif how == "swapped_entries":  # two tensors of different shapes trade their descriptions
        entries["model.0.weight"], entries["model.2.weight"] = (
            entries["model.2.weight"],
            entries["model.0.weight"],
        )
    elif how == "swapped_locations":  # two chunks of one shape and dtype trade places: exp_avg <-> exp_avg_sq
        a, b = item("optim.state.0.weight.exp_avg", [0, 0]), item("optim.state.0.weight.exp_avg_sq", [0, 0])
        a[2], b[2] = b[2], a[2]


@pytest.fixture(scope="module")
def saved_two_steps(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Steps 1 and 2 of a 2-rank FSDP2 model and optimizer, with the reference state of each."""
    out = tmp_path_factory.mktemp("dcp_saved")
    _ranks("save", 2, str(out / "ckpt"), str(out))
    return out


@pytest.mark.slow
@pytest.mark.parametrize("how", ["offset_outside", "shrunk", "dtype", "swapped_entries", "swapped_locations"])
def test_tampered_dcp_metadata_falls_back_on_every_rank(
    saved_two_steps: Path, tmp_path: Path, how: str
) -> None:
    """Metadata that disagrees with the tensors it describes never restores wrong values: step 2 is damaged
    on every rank alike, and every rank restores step 1 bit for bit."""
    shutil.copytree(saved_two_steps, tmp_path / "run")
    manifest_path = tmp_path / "run" / "ckpt" / "step_0000000002" / "manifest.json"
    manifest = json.loads(manifest_path.read_bytes())
    _tamper(manifest["dcp"], how)
    manifest_path.write_text(json.dumps(manifest))
    _ranks("restore", 2, str(tmp_path / "run" / "ckpt"), str(tmp_path / "run"), "1")


@pytest.mark.parametrize(("second_row", "valid"), [(4, True), (2, False)])
def test_chunks_that_overlap_are_damage_even_when_their_volumes_add_up(second_row: int, valid: bool) -> None:
    """An 8x4 tensor in two 4x4 chunks: rows 0..3 and 4..7 tile it; rows 0..3 and 2..5 overlap (and leave
    rows 6..7 unset) although 16 + 16 elements are 8 x 4."""
    from vertexrt.checkpoint.dcp_metadata import decode_metadata
    from vertexrt.errors import CheckpointCorruptError

    leaves = [{"t": "bytes", "chunks": [[0, 64 * i, 64, 0]]} for i in range(2)]
    manifest = {"shards": [{"shard": 0, "tree": {"t": "list", "v": leaves}}]}
    chunks = [[[0, 0], [4, 4]], [[second_row, 0], [4, 4]]]
    value = {
        "version": "1",
        "entries": {
            "w": {"t": "tensor", "dtype": "float32", "requires_grad": False, "size": [8, 4], "chunks": chunks}
        },
        "storage": [
            ["w", offset, {"shard": 0, "leaf": i, "t": "tensor", "dtype": "float32", "shape": [4, 4]}]
            for i, (offset, _) in enumerate(chunks)
        ],
        "planner": {"w": ["w"]},
    }
    if valid:
        assert len(decode_metadata(value, manifest, name="m.json").storage_data) == 2
    else:
        with pytest.raises(CheckpointCorruptError, match="do not cover its size"):
            decode_metadata(value, manifest, name="m.json")

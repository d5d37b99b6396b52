"""The two-level checkpoint metadata: a sharded step is a small header (format version 2) of references to
per-shard body files; replicated steps, and every step of format version 1, keep their bodies inline."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from vertexrt.checkpoint import CheckpointManager
from vertexrt.checkpoint import manifest as manifest_format
from vertexrt.errors import CheckpointCorruptError


def _state(step: int) -> dict:
    return {"w": np.arange(8, dtype=np.int64) * step, "step": step, "names": ["a", "b"]}


def _save_sharded(root: Path, *steps: int) -> None:
    """A one-shard sharded step per ``steps`` (a sharded save of a world of one)."""
    with CheckpointManager(str(root), async_save=False, rank=0, world_size=1) as mgr:
        for step in steps:
            mgr.save(step, _state(step), shard=0, overwrite=True)


def _header(root: Path, step: int) -> dict:
    return json.loads((root / f"step_{step:010d}" / "manifest.json").read_bytes())


def _body_file(root: Path, step: int) -> Path:
    (entry,) = _header(root, step)["shards"]
    return root / f"step_{step:010d}" / entry["body"]["name"]


def _restored(root: Path) -> tuple[int, int | None]:
    with CheckpointManager(str(root), rank=0, world_size=1) as mgr:
        return int(mgr.restore()["step"]), mgr.restored_step


def test_a_sharded_step_is_a_header_of_body_references(tmp_path):
    _save_sharded(tmp_path, 1)
    header = _header(tmp_path, 1)
    assert header["format_version"] == 2 and header["sharded"], header
    (entry,) = header["shards"]
    assert "tree" not in entry and set(entry) == {"shard", "prefix", "files", "body"}, entry
    data = _body_file(tmp_path, 1).read_bytes()
    assert entry["body"]["size"] == len(data)
    body = manifest_format.parse_body(data, name="b", entry=entry, count=1)
    assert body["prefix"] == entry["prefix"] and "tree" in body
    assert _restored(tmp_path) == (1, 1)


@pytest.mark.parametrize("damage", ["flip", "remove", "truncate"])
def test_a_damaged_or_missing_body_file_falls_back_to_the_earlier_step(tmp_path, damage):
    _save_sharded(tmp_path, 1, 2)
    body = _body_file(tmp_path, 2)
    if damage == "remove":
        body.unlink()
    else:
        data = bytearray(body.read_bytes())
        if damage == "flip":
            data[len(data) // 2] ^= 0x01
        body.write_bytes(bytes(data[:-1] if damage == "truncate" else data))
    assert _restored(tmp_path) == (1, 1)


def test_an_overwrite_retires_the_replaced_body_file(tmp_path):
    _save_sharded(tmp_path, 1, 1)
    step = tmp_path / "step_0000000001"
    bodies = [p.name for p in step.iterdir() if p.name.endswith(".body.json")]
    assert bodies == [_body_file(tmp_path, 1).name], sorted(p.name for p in step.iterdir())
    assert _restored(tmp_path) == (1, 1)


def test_a_replicated_step_keeps_its_body_inline_in_format_version_1(tmp_path):
    with CheckpointManager(str(tmp_path), async_save=False, rank=0, world_size=1) as mgr:
        mgr.save(3, _state(3))
    header = _header(tmp_path, 3)
    assert header["format_version"] == 1 and "tree" in header["shards"][0], header
    assert not [p for p in (tmp_path / "step_0000000003").iterdir() if p.name.endswith(".body.json")]
    assert _restored(tmp_path) == (3, 3)


def test_a_format_version_1_sharded_step_still_restores(tmp_path):
    """The step rewritten as vertexrt wrote it before body files: every body inline, version 1."""
    _save_sharded(tmp_path, 1)
    header, path = _header(tmp_path, 1), _body_file(tmp_path, 1)
    body = json.loads(path.read_bytes())
    old = manifest_format.build(step=1, world_size=1, sharded=True, shards=[body], metrics={})
    assert old["format_version"] == 1
    path.unlink()
    (tmp_path / "step_0000000001" / "manifest.json").write_bytes(manifest_format.dumps(old))
    assert header["format_version"] == 2
    assert _restored(tmp_path) == (1, 1)


def _v2_header() -> tuple[dict, bytes]:
    body = {
        "shard": 0,
        "prefix": "data.t.s0",
        "files": {"data.t.s0.00000.bin": 8},
        "tree": {"t": "list", "v": []},
    }
    data = manifest_format.dumps(body)
    header = manifest_format.build(
        step=1, world_size=1, sharded=True, shards=[manifest_format.reference(body, data)], metrics={}
    )
    return header, data


@pytest.mark.parametrize(
    "change",
    [
        lambda h: h["shards"][0]["body"].update(name="../data.t.s0.body.json"),
        lambda h: h["shards"][0]["body"].update(size=-1),
        lambda h: h["shards"][0]["body"].update(crc32c=1 << 32),
        lambda h: h["shards"][0].pop("body"),
        lambda h: h.update(format_version=1),  # version 1 holds every body inline
    ],
)
def test_a_header_entry_out_of_schema_is_corrupt(change):
    header, _ = _v2_header()
    assert manifest_format.parse(manifest_format.dumps(header), name="m")["format_version"] == 2
    change(header)
    with pytest.raises(CheckpointCorruptError, match="manifest m"):
        manifest_format.parse(manifest_format.dumps(header), name="m")


def test_a_body_file_other_than_its_header_entry_is_corrupt():
    header, data = _v2_header()
    entry = header["shards"][0]
    assert manifest_format.parse_body(data, name="b", entry=entry, count=1)["tree"] == {"t": "list", "v": []}
    other = json.loads(data)
    other["files"] = {"data.t.s0.00000.bin": 9}
    forged = manifest_format.dumps(other)
    with pytest.raises(CheckpointCorruptError, match="CRC32C"):
        manifest_format.parse_body(forged, name="b", entry=entry, count=1)
    entry["body"].update(size=len(forged), crc32c=manifest_format.reference(other, forged)["body"]["crc32c"])
    with pytest.raises(CheckpointCorruptError, match="differ from its step header"):
        manifest_format.parse_body(forged, name="b", entry=entry, count=1)

"""CheckpointManager on local disk and on the GCS test server: round trips, commits, faults, retention."""

from __future__ import annotations

import logging
import os
import threading
import time

import numpy as np
import orjson
import pytest
import torch

from vertexrt import paths
from vertexrt.checkpoint import (
    CheckpointCorruptError,
    CheckpointManager,
    EveryNSteps,
    KeepBest,
    KeepLast,
)
from vertexrt.errors import CheckpointError, ConfigError

from .ckpt_helpers import (
    assert_state_equal,
    list_files,
    make_state,
    read_bytes,
    remove,
    write_bytes,
)


def _data_files(root: str, step: int) -> list[str]:
    return [f for f in list_files(root) if f.startswith(f"step_{step:010d}/data.")]


def test_round_trip_plain_numpy_and_torch_state(storage_root):
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    model(torch.randn(4, 8)).sum().backward()
    opt.step()
    state = {
        "model": model,
        "opt": opt,
        "half": torch.arange(6, dtype=torch.bfloat16).reshape(2, 3),
        "mask": torch.tensor([True, False]),
        "np": {"f16": np.ones((2, 2), np.float16), "scalar": np.float32(2.5), "empty": np.zeros((0, 3))},
        "py": [1, -(2**80), 3.25, float("inf"), "x", b"\x00\xff", None, (1, (2,))],
        7: "int key",
    }
    with CheckpointManager(storage_root, async_save=False) as mgr:
        assert mgr.save(3, state) is True
        assert mgr.latest_step() == 3
        got = mgr.restore()
    assert mgr.restored_step == 3
    for name, tensor in model.state_dict().items():
        assert torch.equal(got["model"][name], tensor)
    assert got["opt"]["param_groups"] == opt.state_dict()["param_groups"]
    assert torch.equal(got["opt"]["state"][0]["exp_avg"], opt.state_dict()["state"][0]["exp_avg"])
    assert got["half"].dtype == torch.bfloat16 and torch.equal(got["half"], state["half"])
    assert torch.equal(got["mask"], state["mask"])
    assert got["np"]["f16"].dtype == np.float16 and np.array_equal(got["np"]["f16"], state["np"]["f16"])
    assert isinstance(got["np"]["scalar"], np.float32) and got["np"]["scalar"] == np.float32(2.5)
    assert got["np"]["empty"].shape == (0, 3)
    assert got["py"] == state["py"]
    assert got[7] == "int key"


def test_restore_loads_live_objects_in_place(storage_root):
    torch.manual_seed(0)
    model = torch.nn.Linear(5, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(2, 5)).sum().backward()
    opt.step()
    buf = np.arange(4.0)
    state = {"model": model, "opt": opt, "buf": buf, "t": torch.ones(3), "epoch": 4}
    with CheckpointManager(storage_root, async_save=False) as mgr:
        mgr.save(10, state)
        fresh_model = torch.nn.Linear(5, 3)
        fresh_opt = torch.optim.SGD(fresh_model.parameters(), lr=0.5, momentum=0.9)
        fresh_buf, fresh_t = np.zeros(4), torch.zeros(3)
        out = mgr.restore(
            target={"model": fresh_model, "opt": fresh_opt, "buf": fresh_buf, "t": fresh_t, "epoch": 0}
        )
    assert out["model"] is fresh_model and out["opt"] is fresh_opt
    assert out["buf"] is fresh_buf and out["t"] is fresh_t
    assert torch.equal(fresh_model.weight, model.weight)
    assert fresh_opt.param_groups[0]["lr"] == 0.1
    assert torch.equal(
        fresh_opt.state[fresh_model.weight]["momentum_buffer"], opt.state[model.weight]["momentum_buffer"]
    )
    assert np.array_equal(fresh_buf, buf) and torch.equal(fresh_t, torch.ones(3))
    assert out["epoch"] == 4


def test_async_save_snapshots_before_returning(storage_root):
    weights = torch.zeros(200_000)
    arr = np.zeros(1000)
    with CheckpointManager(storage_root) as mgr:
        assert mgr.save(1, {"w": weights, "a": arr})
        weights.add_(1.0)  # the training step races the background write
        arr += 1
        mgr.wait()
        got = mgr.restore()
    assert torch.count_nonzero(got["w"]) == 0 and not got["a"].any()


def test_save_policy_decides_unless_forced(storage_root):
    with CheckpointManager(storage_root, save_policy=EveryNSteps(5), async_save=False) as mgr:
        saved = [s for s in range(1, 13) if mgr.save(s, {"s": s})]
        assert mgr.save(13, {"s": 13}, force=True)
        assert saved == [5, 10]
        assert mgr.all_steps() == [5, 10, 13]


def test_keep_policies_delete_only_after_commit(storage_root):
    keep = KeepLast(2) | KeepBest("loss", "min")
    losses = {1: 0.5, 2: 0.1, 3: 0.7, 4: 0.9, 5: 0.8}
    with CheckpointManager(storage_root, keep_policy=keep) as mgr:
        for step, loss in losses.items():
            mgr.save(step, {"step": step}, metrics={"loss": loss})
        mgr.wait()
        assert mgr.all_steps() == [2, 4, 5]
        assert mgr.metadata(2)["metrics"] == {"loss": 0.1}
    assert not [f for f in list_files(storage_root) if f.startswith(".tmp") or f.startswith(".trash")]


def test_flipped_byte_is_detected_and_previous_step_restored(storage_root, flip_byte, caplog):
    with CheckpointManager(storage_root, async_save=False) as mgr:
        mgr.save(1, make_state(1))
        mgr.save(2, make_state(2))
    (victim,) = _data_files(storage_root, 2)
    flip_byte(paths.join(storage_root, victim), 200_000)
    with caplog.at_level(logging.WARNING), CheckpointManager(storage_root) as mgr:
        got = mgr.restore()
        assert mgr.restored_step == 1
        with pytest.raises(CheckpointCorruptError, match="checksum mismatch"):
            mgr.restore(step=2)
    assert_state_equal(got, make_state(1))
    assert victim.split("/")[-1] in caplog.text and "step 2" in caplog.text


def test_missing_data_file_falls_back(storage_root, caplog):
    with CheckpointManager(storage_root, async_save=False) as mgr:
        mgr.save(1, make_state(1))
        mgr.save(2, make_state(2))
    (victim,) = _data_files(storage_root, 2)
    remove(paths.join(storage_root, victim))
    with caplog.at_level(logging.WARNING), CheckpointManager(storage_root) as mgr:
        assert mgr.latest_step() == 1
        assert_state_equal(mgr.restore(), make_state(1))
    assert "is missing" in caplog.text and victim.split("/")[-1] in caplog.text


def test_all_steps_corrupt_raises_naming_them(storage_root):
    with CheckpointManager(storage_root, async_save=False) as mgr:
        mgr.save(1, make_state(1))
    write_bytes(paths.join(storage_root, "step_0000000001/manifest.json"), b"{not json")
    with CheckpointManager(storage_root) as mgr, pytest.raises(CheckpointError, match="step 1: manifest"):
        mgr.restore()


def test_newer_format_version_is_a_clear_error(storage_root):
    with CheckpointManager(storage_root, async_save=False) as mgr:
        mgr.save(1, {"x": 1})
    uri = paths.join(storage_root, "step_0000000001/manifest.json")
    manifest = orjson.loads(read_bytes(uri))
    manifest["format_version"] = 99
    write_bytes(uri, orjson.dumps(manifest))
    with CheckpointManager(storage_root) as mgr, pytest.raises(CheckpointError, match="version 99.*upgrade"):
        mgr.restore()


def test_unsupported_object_names_its_tree_path(storage_root):
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    opt.param_groups[0]["fn"] = lambda x: x
    with CheckpointManager(storage_root) as mgr:
        with pytest.raises(CheckpointError, match=r"state\['opt'\]\['param_groups'\]\[0\]\['fn'\]"):
            mgr.save(1, {"model": model, "opt": opt})
        assert mgr.all_steps() == []


def test_pickle_only_when_allowed(storage_root):
    value = {"s": {1, 2, 3}}
    with pytest.raises(CheckpointError, match=r"state\['s'\].*allow_pickle"):
        CheckpointManager(storage_root).save(1, value)
    with CheckpointManager(storage_root, allow_pickle=True, async_save=False) as mgr:
        mgr.save(1, value)
        assert mgr.restore() == value
    with CheckpointManager(storage_root) as mgr, pytest.raises(CheckpointError, match="allow_pickle=True"):
        mgr.restore()


def test_target_shape_mismatch_names_path(storage_root):
    with CheckpointManager(storage_root, async_save=False) as mgr:
        mgr.save(1, {"layer": {"w": torch.ones(3)}})
        target = {"layer": {"w": torch.zeros(4)}}
        with pytest.raises(CheckpointError, match=r"state\['layer'\]\['w'\].*shape \[3\].*\[4\]"):
            mgr.restore(target=target)
        assert torch.count_nonzero(target["layer"]["w"]) == 0


def test_empty_directory_restores_none(storage_root):
    with CheckpointManager(storage_root) as mgr:
        assert mgr.latest_step() is None
        assert mgr.restore(target={"x": 1}) is None


def test_uncommitted_leftovers_are_ignored_then_cleaned(storage_root, dead_pid):
    with CheckpointManager(storage_root, async_save=False) as mgr:
        mgr.save(1, make_state(1))
    from vertexrt.checkpoint.tokens import new_token

    token = new_token().rsplit("-", 2)[0] + f"-{dead_pid}-deadbeef"
    if paths.is_gcs(storage_root):
        leftover = f"step_0000000002/data.{token}.s0.00000.bin"
    else:
        leftover = f".tmp.step_0000000002.{token}/data.{token}.s0.00000.bin"
    write_bytes(paths.join(storage_root, leftover), b"partial")
    live = f"step_0000000003/data.{new_token()}.s0.00000.bin"  # a live writer (this process): kept
    if not paths.is_gcs(storage_root):
        live = f".tmp.step_0000000003.{new_token()}/x.bin"
    write_bytes(paths.join(storage_root, live), b"in progress")
    with CheckpointManager(storage_root) as mgr:
        assert mgr.all_steps() == [1]
        assert_state_equal(mgr.restore(), make_state(1))
    files = list_files(storage_root)
    assert leftover not in files and live in files


def test_async_background_error_is_reraised(storage_root):
    class Exploding:
        def __len__(self):
            raise RuntimeError("boom in the writer")

    with CheckpointManager(storage_root) as mgr:
        mgr.save(1, {"x": np.ones(10)})
        mgr.wait()
        # Corrupt the snapshot hand-off so the background writer fails.
        original = mgr._snapshot
        mgr._snapshot = lambda encoded: [Exploding() for _ in encoded]  # type: ignore[method-assign]
        assert mgr.save(2, {"x": np.ones(10)})
        mgr._snapshot = original  # type: ignore[method-assign]
        with pytest.raises(CheckpointError, match="saving step 2.*boom in the writer"):
            mgr.wait()
        mgr.save(3, {"x": np.full(10, 3.0)})
        mgr.wait()
        assert mgr.all_steps() == [1, 3]
        assert np.array_equal(mgr.restore()["x"], np.full(10, 3.0))


def test_two_managers_on_one_directory_never_corrupt(storage_root):
    errors: list[BaseException] = []

    def writer(tag: int) -> None:
        try:
            with CheckpointManager(storage_root, keep_policy=KeepLast(3)) as mgr:
                for step in range(8):
                    state = make_state(step * 10 + tag, sizes=(40_000, 5_000))
                    state["writer"] = tag
                    mgr.save(step, state, overwrite=True)  # both write every step: replaced atomically
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=writer, args=(tag,)) for tag in (1, 2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    # a save may fail when the other writer's retention deletes the step it is replacing: a typed error,
    # never a corrupt directory
    assert all(isinstance(e, CheckpointError) for e in errors), errors
    with CheckpointManager(storage_root) as mgr:
        steps = mgr.all_steps()
        assert steps and steps[-1] == 7
        for step in steps:
            got = mgr.restore(step=step)  # raises on any corruption
            want = make_state(step * 10 + got["writer"], sizes=(40_000, 5_000))
            want["writer"] = got["writer"]
            assert_state_equal(got, want)


def test_large_leaf_spans_several_parts(storage_root):
    big = np.random.default_rng(0).integers(0, 255, size=3_000_000, dtype=np.uint8)
    with CheckpointManager(storage_root) as mgr:
        mgr._strategy.part_size = 1 << 20
        mgr.save(1, {"big": big, "small": np.arange(3)})
        mgr.wait()
        assert len(_data_files(storage_root, 1)) == 3
        got = mgr.restore()
    assert np.array_equal(got["big"], big) and np.array_equal(got["small"], np.arange(3))


def test_fuse_path_writes_in_place_with_manifest_last(tmp_path, monkeypatch):
    monkeypatch.setenv("VERTEXRT_FUSE_ROOT", str(tmp_path / "mnt"))
    (tmp_path / "mnt" / "bucket").mkdir(parents=True)
    with CheckpointManager("/gcs/bucket/run/ckpt", async_save=False) as mgr:
        from vertexrt.checkpoint.storage import MarkerStrategy
        from vertexrt.checkpoint.stores import OsStore

        # a mount: files written in place through the OS, committed by the manifest (no directory rename)
        assert isinstance(mgr._strategy, MarkerStrategy) and isinstance(mgr._strategy.store, OsStore)
        mgr.save(1, make_state(1))
        assert_state_equal(mgr.restore(), make_state(1))
    step_dir = tmp_path / "mnt" / "bucket" / "run" / "ckpt" / "step_0000000001"
    names = sorted(p.name for p in step_dir.iterdir())
    assert names[-1] == "manifest.json" and names[0].startswith("data.")
    assert not [p for p in step_dir.parent.iterdir() if p.name.startswith(".tmp")]


def test_another_hosts_leftovers_are_removed_only_when_stale(tmp_path):
    root = tmp_path / "ckpt"
    old = root / ".tmp.step_0000000005.otherhost-123-deadbeef"
    fresh = root / ".tmp.step_0000000006.otherhost-124-deadbeef"
    for leftover in (old, fresh):
        leftover.mkdir(parents=True)
        (leftover / "data.bin").write_bytes(b"x")
    os.utime(old, (time.time() - 3600, time.time() - 3600))
    with CheckpointManager(str(root), stale_after=600):
        pass
    assert not old.exists() and fresh.exists()


def test_bad_steps_and_nan_metrics(tmp_path):
    keep = KeepLast(1) | KeepBest("loss")
    with CheckpointManager(str(tmp_path), keep_policy=keep, async_save=False) as mgr:
        for bad in (-1, 1.5, "3", True):
            with pytest.raises(ConfigError, match="step must be an integer"):
                mgr.save(bad, {})
        mgr.save(np.int64(1), {}, metrics={"loss": float("nan")})
    with CheckpointManager(str(tmp_path), keep_policy=keep, async_save=False) as mgr:
        mgr.save(2, {}, metrics={"loss": 0.5})  # reads step 1's NaN (stored as null) back without failing
        assert mgr.all_steps() == [2]
        mgr.save(3, {}, metrics={"loss": 0.7})
        assert mgr.all_steps() == [2, 3]


def test_restored_values_outlive_their_step_and_are_private(storage_root):
    with CheckpointManager(storage_root, keep_policy=KeepLast(1), async_save=False) as mgr:
        mgr.save(1, {"w": torch.arange(1000.0), "a": np.arange(10)})
        got = mgr.restore()
        got["w"].add_(1.0)  # writable, and writing does not touch the checkpoint
        got["a"][0] = 42
        assert_state_like = mgr.restore()
        assert torch.equal(assert_state_like["w"], torch.arange(1000.0))
        mgr.save(2, {"w": torch.zeros(3), "a": np.zeros(1)})  # deletes step 1
        assert mgr.all_steps() == [2]
    assert torch.equal(got["w"], torch.arange(1000.0) + 1) and got["a"][0] == 42


def test_a_rolled_back_save_is_kept_and_the_newer_step_is_flagged(tmp_path, caplog) -> None:
    from vertexrt.checkpoint import CheckpointManager, KeepLast

    with CheckpointManager(str(tmp_path), keep_policy=KeepLast(1), async_save=False) as mgr:
        for step in (10, 20, 30):
            mgr.save(step, {"step": step}, force=True)
        mgr.wait()
        assert mgr.all_steps() == [30]
        mgr.save(21, {"step": 21}, force=True)  # training rolled back to an older state and went on
        mgr.wait()
        assert mgr.all_steps() == [21, 30]  # the step just saved survives its own retention pass
    assert "step 30 is newer" in caplog.text


def test_retention_on_a_fuse_mount_deletes_old_steps(tmp_path, monkeypatch) -> None:
    from vertexrt.checkpoint import CheckpointManager, KeepLast

    monkeypatch.setenv("VERTEXRT_FUSE_ROOT", str(tmp_path / "mnt"))
    (tmp_path / "mnt" / "fuse-bucket").mkdir(parents=True)
    with CheckpointManager("/gcs/fuse-bucket/ckpt", keep_policy=KeepLast(1), async_save=False) as mgr:
        for step in (1, 2, 3):
            mgr.save(step, {"step": step}, force=True)
        mgr.wait()
        assert mgr.all_steps() == [3]
    remaining = sorted(p.name for p in (tmp_path / "mnt" / "fuse-bucket" / "ckpt").iterdir())
    assert remaining == ["step_0000000003"]


def test_unsupported_scheme_is_refused_not_written_to_local_disk() -> None:
    from vertexrt.checkpoint import CheckpointManager
    from vertexrt.errors import PathError

    with pytest.raises(PathError, match=r"'memory://bkt/ckpt'.*only local paths, /gcs/ paths and gs:// URIs"):
        CheckpointManager("memory://bkt/ckpt")


def test_leftover_of_an_earlier_process_with_the_same_pid_is_cleaned(tmp_path) -> None:
    import os

    from vertexrt.checkpoint import CheckpointManager
    from vertexrt.checkpoint.tokens import host_name

    stale = tmp_path / f".tmp.step_0000000005.{host_name()}-{os.getpid()}-deadbeef"
    stale.mkdir()
    (stale / "data.bin").write_bytes(b"partial")
    with CheckpointManager(str(tmp_path)):
        pass
    assert not stale.exists()


def test_routine_commits_and_retention_stay_out_of_the_info_log(tmp_path, caplog: pytest.LogCaptureFixture):
    """A Keras trial checkpointing every 50 steps logged a commit and a deletion at INFO each time: only the
    first commit is INFO now (it says where checkpoints go), the rest is DEBUG."""
    caplog.set_level(logging.INFO, logger="vertexrt.checkpoint")
    with CheckpointManager(str(tmp_path), keep_policy=KeepLast(2), async_save=False) as mgr:
        for step in range(1, 7):
            mgr.save(step, {"w": torch.ones(2) * step}, force=True)
        mgr.wait()
    info = [r.getMessage() for r in caplog.records if r.name.startswith("vertexrt.checkpoint")]
    assert info == [f"checkpoint step 1 committed in {tmp_path} (later commits are logged at DEBUG)"], info
    assert mgr.all_steps() == [5, 6]

"""Commits never lose a step: refused re-saves, atomic overwrites, one writer and one deleter thread."""

from __future__ import annotations

import os
import signal
import threading
import tracemalloc

import numpy as np
import pytest

from vertexrt.checkpoint import CheckpointManager, KeepLast
from vertexrt.errors import ClusterSpecError, StepExistsError

from .ckpt_helpers import assert_state_equal, list_files, make_state


def _files(root: str, step: int) -> list[str]:
    return [f for f in list_files(root) if f.startswith(f"step_{step:010d}/")]


def test_resaving_a_committed_step_is_refused_and_leaves_it_untouched(storage_root):
    with CheckpointManager(storage_root, async_save=False) as mgr:
        mgr.save(1, make_state(1))
        before = _files(storage_root, 1)
        with pytest.raises(StepExistsError, match=r"step 1 is already committed.*overwrite=True"):
            mgr.save(1, make_state(2), force=True)
        assert _files(storage_root, 1) == before  # no orphaned data files
        assert_state_equal(mgr.restore(), make_state(1))


def test_a_racing_commit_of_the_same_step_is_refused_at_commit(storage_root, monkeypatch):
    with (
        CheckpointManager(storage_root, async_save=False) as first,
        CheckpointManager(storage_root, async_save=False) as second,
    ):
        monkeypatch.setattr(second._strategy, "is_committed", lambda step: False)  # it looked too early
        first.save(1, make_state(1))
        before = _files(storage_root, 1)
        with pytest.raises(StepExistsError):
            second.save(1, make_state(2))
        assert _files(storage_root, 1) == before  # the loser's data files are gone again
        assert_state_equal(first.restore(), make_state(1))


def test_overwrite_replaces_the_step_and_deletes_the_old_files(storage_root):
    with CheckpointManager(storage_root, async_save=False) as mgr:
        mgr.save(1, make_state(1))
        old = [f for f in _files(storage_root, 1) if "/data." in f]
        assert mgr.save(1, make_state(2), force=True, overwrite=True)
        assert_state_equal(mgr.restore(), make_state(2))
        assert mgr.all_steps() == [1]
    data = [f for f in _files(storage_root, 1) if "/data." in f]
    assert data and not set(old) & set(data)


@pytest.mark.parametrize("crash_at", range(1, 8))
def test_an_overwrite_killed_at_any_rename_leaves_a_committed_copy(tmp_path, monkeypatch, crash_at):
    root = str(tmp_path)
    with CheckpointManager(root, async_save=False) as mgr:
        mgr.save(1, make_state(1))
    calls = {"n": 0}
    real_rename, real_replace = os.rename, os.replace

    class Crash(BaseException):
        pass

    def counting(real):
        def op(src, dst, *args, **kwargs):
            calls["n"] += 1
            if calls["n"] == crash_at:
                raise Crash(f"killed at rename {crash_at}")
            return real(src, dst, *args, **kwargs)

        return op

    mgr = CheckpointManager(root, async_save=False)
    monkeypatch.setattr(os, "rename", counting(real_rename))
    monkeypatch.setattr(os, "replace", counting(real_replace))
    try:
        mgr.save(1, make_state(2), force=True, overwrite=True)
    except Crash:
        pass
    monkeypatch.undo()
    mgr.close()
    with CheckpointManager(root) as fresh:
        assert fresh.all_steps() == [1]
        got = fresh.restore()
    assert got["step"] in (1, 2)
    assert_state_equal(got, make_state(got["step"]))


def test_one_writer_and_one_deleter_thread_and_close_finishes_them(storage_root):
    def ours() -> set[threading.Thread]:
        return {t for t in threading.enumerate() if t.name.startswith("vertexrt-checkpoint")} - earlier

    earlier = {t for t in threading.enumerate() if t.name.startswith("vertexrt-checkpoint")}
    seen: set[threading.Thread] = set()
    with CheckpointManager(storage_root, keep_policy=KeepLast(1)) as mgr:
        for step in range(6):
            mgr.save(step, {"x": np.full(1000, step)})
            seen |= ours()
    assert len(seen) <= 2, sorted(t.name for t in seen)
    assert not ours()  # close() finished the pending work and ended both threads
    with CheckpointManager(storage_root) as mgr:
        assert mgr.all_steps() == [5]


def test_tokens_do_not_accumulate_state_and_stay_live(tmp_path):
    from vertexrt.checkpoint import storage, tokens

    strategy = storage.strategy_for(str(tmp_path))
    tokens.new_token()
    tracemalloc.start()
    try:
        before = tracemalloc.take_snapshot()
        made = [tokens.new_token() for _ in range(20_000)]
        del made
        after = tracemalloc.take_snapshot()
    finally:
        tracemalloc.stop()
    grown = sum(s.size_diff for s in after.compare_to(before, "filename") if "tokens.py" in str(s.traceback))
    assert grown < 64_000
    assert not strategy.dead(f"data.{tokens.new_token()}.s0.00000.bin", 0.0)


def test_a_malformed_cluster_description_is_an_error_not_rank_0_of_1(tmp_path, monkeypatch):
    monkeypatch.setenv("CLUSTER_SPEC", "{not json")
    with pytest.raises(ClusterSpecError, match="CLUSTER_SPEC"):
        CheckpointManager(str(tmp_path))


def test_preemption_goes_through_the_one_signal_owner(tmp_path):
    original = signal.getsignal(signal.SIGTERM)
    first = CheckpointManager(str(tmp_path / "a"), save_on_preemption=True)
    second = CheckpointManager(str(tmp_path / "b"), save_on_preemption=True)
    try:
        assert first.preemption_requested() is False
        os.kill(os.getpid(), signal.SIGTERM)
        assert first.preemption_requested() is True and second.preemption_requested() is True
    finally:
        first.close()  # closed in creation order: the original handler must come back anyway
        second.close()
    assert signal.getsignal(signal.SIGTERM) is original


def test_retention_never_follows_a_step_symlink_on_a_fuse_mount(tmp_path, monkeypatch):
    monkeypatch.setenv("VERTEXRT_FUSE_ROOT", str(tmp_path / "mnt"))
    other = tmp_path / "mnt" / "bkt" / "other-run"
    (tmp_path / "mnt" / "bkt").mkdir(parents=True)
    with CheckpointManager("/gcs/bkt/other-run", async_save=False) as mgr:
        mgr.save(1, {"x": 1})
    ours = tmp_path / "mnt" / "bkt" / "ours"
    ours.mkdir()
    (ours / "step_0000000001").symlink_to(other / "step_0000000001")
    with CheckpointManager("/gcs/bkt/ours", keep_policy=KeepLast(1), async_save=False) as mgr:
        mgr.save(2, {"x": 2})
        mgr.save(3, {"x": 3})
    assert sorted(p.name for p in (other / "step_0000000001").iterdir())[-1] == "manifest.json"
    assert (other / "step_0000000001" / "manifest.json").is_file()

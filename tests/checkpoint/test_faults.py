"""Faults: the writer SIGKILLed at random points (local disk and the GCS server), and a full disk."""

from __future__ import annotations

import os
import random
import subprocess
import sys
import time

import pytest

from vertexrt.checkpoint import CheckpointManager

from .ckpt_helpers import assert_state_equal, disk_full_scenario, make_state

HERE = os.path.dirname(os.path.abspath(__file__))
KILLS = {"local": 28, "gcs": 22}


def _spawn_writer(root: str) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([HERE, os.environ.get("PYTHONPATH", "")]))
    return subprocess.Popen(
        [sys.executable, os.path.join(HERE, "kill_writer.py"), root],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        env=env,
        text=True,
    )


@pytest.mark.slow
def test_random_sigkills_never_expose_a_partial_checkpoint(storage_root):
    kind = "gcs" if storage_root.startswith("gs://") else "local"
    rng = random.Random(1234)
    previous = -1
    for _ in range(KILLS[kind]):
        proc = _spawn_writer(storage_root)
        try:
            assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
            time.sleep(rng.uniform(0.0, 0.4))
        finally:
            proc.kill()
            proc.wait(timeout=60)
        with CheckpointManager(
            storage_root, async_save=False
        ) as mgr:  # also cleans the dead writer's leftovers
            steps = mgr.all_steps()
            latest = mgr.latest_step()
            assert latest == (steps[-1] if steps else None)
            for step in steps:  # every committed step is complete and bit-exact
                assert_state_equal(mgr.restore(step=step), make_state(step))
        latest = -1 if latest is None else latest
        assert latest >= previous  # a committed step is never lost
        previous = latest
    assert previous >= KILLS[kind] // 3, "the writer made too little progress for the kills to mean much"


def _mount_tmpfs(path: str, size: str) -> bool:
    os.makedirs(path, exist_ok=True)
    try:
        done = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", path], capture_output=True, timeout=30
        )
    except (OSError, subprocess.TimeoutExpired):
        return False
    return done.returncode == 0


def test_disk_full_is_a_clear_error_and_earlier_checkpoints_survive(tmp_path):
    root = str(tmp_path / "small")
    if _mount_tmpfs(root, "4m"):  # a real size-limited filesystem (needs root)
        try:
            outcome = disk_full_scenario(root)
        finally:
            subprocess.run(["umount", root], timeout=30, check=False)
        expected_error = "No space left on device"
    else:  # no mount rights: a per-process file size limit (RLIMIT_FSIZE) in a subprocess
        os.makedirs(root, exist_ok=True)
        code = (
            "import resource, signal, sys; signal.signal(signal.SIGXFSZ, signal.SIG_IGN); "
            "resource.setrlimit(resource.RLIMIT_FSIZE, (4 << 20, 4 << 20)); "
            f"sys.path.insert(0, {HERE!r}); from ckpt_helpers import disk_full_scenario; "
            f"print(disk_full_scenario({root!r}))"
        )
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        outcome = done.stdout.strip()
        expected_error = "File too large"
    assert expected_error in outcome and "saving step 2" in outcome
    assert "steps=[1]" in outcome and "leftovers=[]" in outcome and "after=[1, 3]" in outcome

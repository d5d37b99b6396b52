"""Faults: the writer SIGKILLed at random points (local disk and the GCS server), a full disk, and Cloud
Storage that stalls, resets connections or answers 503 (a fault proxy in front of the GCS server)."""

from __future__ import annotations

import os
import random
import subprocess
import sys
import time
import uuid

import pytest

from vertexrt.checkpoint import CheckpointManager
from vertexrt.checkpoint.datafiles import CheckpointCorruptError
from vertexrt.errors import CheckpointError, ConfigError
from vertexrt.retries import storage_timeout

from .ckpt_helpers import assert_state_equal, disk_full_scenario, make_state

TEST_BUCKET = "vertexrt-test"
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
            # Each life commits a step before the kill (a random time into a later save): a kill at a fixed
            # time after "ready" found no step committed yet when the machine was starved of CPU, and
            # the writer's progress check failed. Waiting for the line is an event, not a timing.
            line = proc.stdout.readline()
            assert line.startswith("committed "), line
            committed = int(line.split()[1])
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
        assert latest is not None and latest >= max(previous, committed)  # a committed step is never lost
        previous = latest


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


# -- Cloud Storage that stops answering: every call has a deadline and fails with a typed error -----------

OUTAGES = ["stall", "reset", "503"]


@pytest.fixture
def gcs_root(fault_proxy, monkeypatch) -> str:
    """A fresh prefix on the GCS server, reached through the fault proxy; storage calls time out after 2 s."""
    monkeypatch.setenv("VERTEXRT_STORAGE_TIMEOUT", "2")
    return f"gs://{TEST_BUCKET}/{uuid.uuid4().hex}"


def _commit(root: str, step: int) -> None:
    with CheckpointManager(root, async_save=False) as mgr:
        mgr.save(step, make_state(step))


def _assert_intact(root: str, steps: list[int]) -> None:
    with CheckpointManager(root, async_save=False) as mgr:
        assert mgr.all_steps() == steps
        assert mgr.latest_step() == steps[-1]
        assert_state_equal(mgr.restore(), make_state(steps[-1]))


def _assert_outage_error(exc: pytest.ExceptionInfo[CheckpointError], root: str) -> None:
    assert not isinstance(exc.value, CheckpointCorruptError)  # an outage is not a reason to skip a step
    assert root in str(exc.value), str(exc.value)


@pytest.mark.timeout(90)
@pytest.mark.parametrize("mode", OUTAGES)
@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_save_during_an_outage_fails_in_time_and_keeps_earlier_steps(gcs_root, fault_proxy, mode, async_save):
    _commit(gcs_root, 1)
    with CheckpointManager(gcs_root, async_save=async_save) as mgr:
        fault_proxy.set(mode)
        with pytest.raises(CheckpointError) as exc:
            mgr.save(2, make_state(2))
            mgr.wait()
        _assert_outage_error(exc, gcs_root)
        fault_proxy.set("pass")
    _assert_intact(gcs_root, [1])


@pytest.mark.timeout(60)
def test_a_stall_at_the_commit_fails_in_time_and_leaves_the_step_uncommitted(gcs_root, fault_proxy):
    _commit(gcs_root, 1)
    with CheckpointManager(gcs_root, async_save=False) as mgr:
        manifest_upload = r'^POST .*"name": ?"[^"]*/manifest\.json"'
        fault_proxy.set("stall", match=manifest_upload)  # only the upload of the commit marker
        with pytest.raises(CheckpointError) as exc:
            mgr.save(2, make_state(2))
        _assert_outage_error(exc, gcs_root)
        assert "manifest.json" in str(exc.value)
        assert fault_proxy.handled["stall"] == 1
        fault_proxy.set("pass")
    _assert_intact(gcs_root, [1])


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", OUTAGES)
def test_reads_during_an_outage_raise_a_typed_error_naming_the_uri(gcs_root, fault_proxy, mode):
    _commit(gcs_root, 1)
    with CheckpointManager(gcs_root, async_save=False) as mgr:
        fault_proxy.set(mode)
        for call in (mgr.all_steps, mgr.latest_step, mgr.restore):
            with pytest.raises(CheckpointError) as exc:
                call()
            _assert_outage_error(exc, gcs_root)
        with pytest.raises(CheckpointError) as exc:
            CheckpointManager(gcs_root)
        _assert_outage_error(exc, gcs_root)
        fault_proxy.set("pass")
    _assert_intact(gcs_root, [1])


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", ["503", "reset", "cut"])
def test_transient_faults_are_retried_and_the_save_succeeds(gcs_root, fault_proxy, monkeypatch, mode):
    monkeypatch.setenv("VERTEXRT_STORAGE_TIMEOUT", "60")
    _commit(gcs_root, 1)
    fault_proxy.set(mode, count=2)
    _commit(gcs_root, 2)
    assert fault_proxy.handled[mode] == 2
    _assert_intact(gcs_root, [1, 2])
    assert_state_equal(CheckpointManager(gcs_root).restore(step=1), make_state(1))


@pytest.mark.parametrize("value", ["abc", "0", "-3", "nan", "1e9"])
def test_a_bad_storage_timeout_is_a_config_error_naming_the_variable(monkeypatch, value):
    monkeypatch.setenv("VERTEXRT_STORAGE_TIMEOUT", value)
    with pytest.raises(ConfigError, match="VERTEXRT_STORAGE_TIMEOUT"):
        storage_timeout("data")

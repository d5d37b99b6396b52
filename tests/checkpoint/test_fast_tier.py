"""The fast checkpoint tier across three real gloo ranks (each rank its own "VM" and local directory).

Fast tier every 5 steps, durable every 40: a rank SIGKILLed at step 48 whose local disk is wiped comes back
from step 45 with its state from its peer's copy, without reading the durable tier, and ends with the weights
of an uninterrupted run; with its peer's disk wiped too, the ranks fall back to the durable step 40.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from vertexrt._net import free_port

from .ckpt_helpers import HERE, list_files, read_bytes, write_bytes

WORLD = 3
TOTAL = 52
DIE_AT = 48
VICTIM = 1
#: Seconds a launch may take before it counts as hung (3 torch processes on a loaded 2-core machine).
TIMEOUT = 300


def _launch(
    durable: str, local_root: str, die_at: int = -1, term_at: int = -1, env: dict[str, str] | None = None
) -> list[tuple[int, str, str]]:
    """The three ranks; with ``die_at``, the victim SIGKILLs itself and the others are then killed too (a
    whole-job restart, as Vertex does with restartJobOnWorkerRestart)."""
    port = free_port()
    path = [HERE, os.path.dirname(HERE), os.environ.get("PYTHONPATH", "")]
    env = dict(os.environ, **(env or {}), PYTHONPATH=os.pathsep.join(path))
    argv = [durable, local_root, str(TOTAL), str(die_at), str(term_at)]
    procs = [
        subprocess.Popen(
            [sys.executable, os.path.join(HERE, "fast_worker.py"), str(rank), str(WORLD), str(port), *argv],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for rank in range(WORLD)
    ]
    try:
        if die_at >= 0:
            procs[VICTIM].wait(timeout=TIMEOUT)
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
        outputs = [proc.communicate(timeout=TIMEOUT) for proc in procs]
    except subprocess.TimeoutExpired:
        for proc in procs:
            proc.kill()
        tails = [proc.communicate()[1][-3000:] for proc in procs]
        pytest.fail(f"the ranks did not finish in {TIMEOUT} s: " + "\n".join(tails))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=30)
    return [(proc.returncode, out, err) for proc, (out, err) in zip(procs, outputs, strict=True)]


def _finished(results: list[tuple[int, str, str]]) -> list[dict]:
    reports = []
    for rank, (code, out, err) in enumerate(results):
        assert code == 0, f"rank {rank} failed:\n{err[-4000:]}"
        reports.append(json.loads(out.strip().splitlines()[-1]))
    return reports


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    base = tmp_path_factory.mktemp("reference")
    return _finished(_launch(str(base / "durable"), str(base / "local")))


def _crash(durable: str, local_root: str) -> None:
    results = _launch(durable, local_root, die_at=DIE_AT)
    assert results[VICTIM][0] == -9, results[VICTIM][2][-3000:]


def _durable_data_files(durable: str) -> list[str]:
    return [f for f in list_files(durable) if f.endswith(".bin")]


def _spoil(durable: str) -> None:
    """Flip a byte in every durable data file: a restore that read durable state would fail its checksum."""
    for name in _durable_data_files(durable):
        uri = f"{durable}/{name}"
        data = bytearray(read_bytes(uri))
        data[0] ^= 0xFF
        write_bytes(uri, bytes(data))


@pytest.mark.slow
def test_a_lost_vm_heals_from_its_peer_without_reading_the_durable_tier(
    request, tmp_path, storage_root, uninterrupted
):
    local = tmp_path / "local"
    _crash(storage_root, str(local))
    assert any(name.startswith("step_0000000040/") for name in list_files(storage_root))
    shutil.rmtree(local / f"replica{VICTIM}")  # the replacement VM has an empty local disk
    _spoil(storage_root)
    proxy = None
    if storage_root.startswith("gs://"):  # count the requests for durable data files (and fail them)
        proxy = request.getfixturevalue("fault_proxy")
        proxy.set("503", match=r"^GET [^ ]*\.bin")

    results = _launch(storage_root, str(local))
    if proxy is not None:
        assert proxy.handled["503"] == 0 and proxy.handled["pass"] > 0, proxy.handled
    reports = _finished(results)
    assert [r["resumed"] for r in reports] == [45] * WORLD, reports  # a fast step newer than durable 40
    assert [r["weights"] for r in reports] == [r["weights"] for r in uninterrupted]
    assert [r["position"] for r in reports] == [TOTAL] * WORLD
    logs = [err for _, _, err in results]
    assert "fast checkpoint step 45 comes from the copy kept by rank 2" in logs[VICTIM], logs[VICTIM][-3000:]
    for rank in (0, 2):
        assert "fast checkpoint step 45 comes from its local copy" in logs[rank], logs[rank][-3000:]
    assert not any("skipping checkpoint step" in log for log in logs)  # no durable step was read


@pytest.mark.slow
def test_two_lost_vms_in_one_peer_group_fall_back_to_the_durable_tier(tmp_path, uninterrupted):
    durable, local = str(tmp_path / "durable"), tmp_path / "local"
    _crash(durable, str(local))
    for rank in (VICTIM, VICTIM + 1):  # rank 1's copies live on rank 2: both gone
        shutil.rmtree(local / f"replica{rank}")

    results = _launch(durable, str(local))
    reports = _finished(results)
    assert [r["resumed"] for r in reports] == [40] * WORLD, reports
    assert [r["weights"] for r in reports] == [r["weights"] for r in uninterrupted]
    assert all("its state comes from the durable tier" in err for _, _, err in results)


@pytest.mark.slow
def test_a_damaged_or_partial_fast_step_is_skipped_for_a_peer_copy(tmp_path, uninterrupted):
    durable, local = str(tmp_path / "durable"), tmp_path / "local"
    _crash(durable, str(local))
    own = next((local / "replica0").glob("vertexrt-fast/*/rank_0/own"))
    newest = own / "step_0000000045"
    part = next(newest.glob("*.bin"))
    data = bytearray(part.read_bytes())
    data[len(data) // 2] ^= 0xFF
    part.write_bytes(bytes(data))  # damaged: its checksum fails when read
    shutil.copytree(newest, own / ".tmp.step_0000000050.host-1-0123456789abcdef")  # a save cut short
    shutil.copytree(newest, own / "step_0000000050")
    os.remove(own / "step_0000000050" / "manifest.json")  # never committed

    results = _launch(durable, str(local))
    reports = _finished(results)
    assert [r["resumed"] for r in reports] == [45] * WORLD, reports
    assert [r["weights"] for r in reports] == [r["weights"] for r in uninterrupted]
    assert "fast checkpoint step 45 is unusable: checksum mismatch" in results[0][2], results[0][2][-3000:]
    assert "fast checkpoint step 45 comes from the copy kept by rank 1" in results[0][2]


@pytest.mark.slow
def test_an_emergency_save_that_cannot_fit_the_grace_leaves_complete_peer_copies(tmp_path, uninterrupted):
    durable, local = str(tmp_path / "durable"), tmp_path / "local"
    grace = {"VERTEXRT_PREEMPTION_GRACE": "1"}  # no time for a durable save
    stopped = []
    for rank, (code, out, err) in enumerate(_launch(durable, str(local), term_at=46, env=grace)):
        assert code == 143, f"rank {rank}:\n{err[-4000:]}"
        stopped.append(json.loads(out.strip().splitlines()[-1]))
    step = stopped[0]["stopped"]
    assert step > 45 and stopped == [{"stopped": step, "durable": False}] * WORLD, stopped
    assert sorted({name.split("/")[0] for name in list_files(durable)}) == [
        "step_0000000000",
        "step_0000000040",
    ]
    shutil.rmtree(local / f"replica{VICTIM}")  # and that VM is gone: its emergency step lives on rank 2

    results = _launch(durable, str(local))
    reports = _finished(results)
    assert [r["resumed"] for r in reports] == [step] * WORLD, reports
    assert [r["weights"] for r in reports] == [r["weights"] for r in uninterrupted]
    assert f"fast checkpoint step {step} comes from the copy kept by rank 2" in results[VICTIM][2]

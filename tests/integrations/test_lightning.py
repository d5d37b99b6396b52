"""Lightning through vertexrt: the environment from CLUSTER_SPEC, checkpoints through the manager, and the
example as a preempted 2-replica job under local-run (real lightning, gloo, CPU)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from jobs import run_job

pytest.importorskip("lightning", reason="the lightning extra is not installed")
import torch  # noqa: E402

from vertexrt.errors import ConfigError  # noqa: E402
from vertexrt.integrations.lightning import VertexCheckpointIO, VertexEnvironment  # noqa: E402

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "lightning_classifier.py"


def spec(workers: int, index: int) -> str:
    pools = [{"name": "workerpool0", "addresses": ["chief:2222"]}]
    if workers > 1:
        pools.append({"name": "workerpool1", "addresses": [f"w{i}:2222" for i in range(workers - 1)]})
    pool = "workerpool0" if index == 0 else "workerpool1"
    return json.dumps({"cluster": {p["name"]: p["addresses"] for p in pools},
                       "task": {"type": pool, "index": max(index - 1, 0)}})  # fmt: skip


def test_environment_reads_ranks_and_rendezvous_from_cluster_spec(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("LOCAL_RANK", "LOCAL_WORLD_SIZE", "RANK", "GROUP_RANK", "TF_CONFIG"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("CLUSTER_SPEC", spec(3, 2))
    monkeypatch.setenv("MASTER_ADDR", "chief")
    monkeypatch.setenv("MASTER_PORT", "3333")
    monkeypatch.setenv("WORLD_SIZE", "3")
    monkeypatch.setenv("RANK", "2")
    env = VertexEnvironment()
    assert VertexEnvironment.detect()
    assert (env.world_size(), env.global_rank(), env.node_rank(), env.local_rank()) == (3, 2, 2, 0)
    assert (env.main_address, env.main_port) == ("chief", 3333)
    with pytest.raises(ConfigError, match="num_nodes=2"):
        env.validate_settings(num_devices=1, num_nodes=2)
    env.validate_settings(num_devices=1, num_nodes=3)
    assert env.creates_processes_externally  # one process per replica: Lightning starts none


def test_environment_with_lightning_starting_one_process_per_device(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("LOCAL_RANK", "LOCAL_WORLD_SIZE", "RANK", "GROUP_RANK", "GROUP_WORLD_SIZE", "TF_CONFIG"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("CLUSTER_SPEC", spec(2, 1))
    monkeypatch.setenv("MASTER_ADDR", "chief")
    monkeypatch.setenv("MASTER_PORT", "3333")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    env = VertexEnvironment()
    env.validate_settings(num_devices=4, num_nodes=2)
    assert not env.creates_processes_externally  # Lightning starts the 4 processes of this replica
    monkeypatch.delenv("RANK")
    monkeypatch.setenv("LOCAL_RANK", "3")  # what Lightning's launcher gives its 4th process
    child = VertexEnvironment()
    assert child.creates_processes_externally
    assert (child.global_rank(), child.world_size(), child.node_rank(), child.local_rank()) == (7, 8, 1, 3)
    assert os.environ["RANK"] == "7"  # the rest of vertexrt sees the same rank
    from vertexrt.distributed import cluster

    assert (cluster().rank, cluster().local_world_size) == (7, 4)


def test_checkpoint_io_saves_through_the_manager_and_loads_by_step(tmp_path: Path) -> None:
    io = VertexCheckpointIO(str(tmp_path / "ckpt"), async_save=False)
    checkpoint = {"global_step": 7, "state_dict": {"w": torch.arange(3.0)}, "loops": {"x": [1, 2]}}
    io.save_checkpoint(checkpoint, tmp_path / "epoch=0-step=7.ckpt")
    io.save_checkpoint({**checkpoint, "loops": {"x": [3]}}, tmp_path / "last.ckpt")  # same step: replaced
    assert io.latest_path() == io.path_for(7)
    loaded = io.load_checkpoint(io.latest_path())
    assert torch.equal(loaded["state_dict"]["w"], torch.arange(3.0)) and loaded["loops"] == {"x": [3]}
    assert io.load_checkpoint("anything/epoch=0-step=7.ckpt")["global_step"] == 7
    with pytest.raises(ConfigError, match="names no step"):
        io.load_checkpoint(tmp_path / "last.ckpt")


def local_run(
    tmp: Path, name: str, launcher: list[str], example: list[str]
) -> subprocess.CompletedProcess[str]:
    base = ["local-run", "--workers", "2", "--base-output-dir", str(tmp / name)]
    return run_job(
        [
            sys.executable,
            "-m",
            "vertexrt.cli",
            *base,
            *launcher,
            "--",
            sys.executable,
            str(EXAMPLE),
            *example,
        ],
        cwd=tmp,
        timeout=400,
    )


@pytest.mark.slow
def test_example_preempted_mid_epoch_or_on_an_epochs_last_batch_resumes_to_the_same_weights(
    tmp_path: Path,
) -> None:
    started = time.monotonic()
    reference = local_run(tmp_path, "reference", [], [])
    assert reference.returncode == 0, reference.stdout[-5000:]
    assert "done: 48 steps" in reference.stdout, reference.stdout[-5000:]
    elapsed = time.monotonic() - started
    # rank 0 reported the monitored metric to hypertune after each epoch's validation
    reports = (tmp_path / "reference" / "hypertune" / "output.metrics").read_text().splitlines()
    assert [json.loads(line)["global_step"] for line in reports] == ["16", "32", "48"], reports
    assert all(float(json.loads(line)["val_loss"]) > 0 for line in reports), reports
    expected = torch.load(tmp_path / "reference" / "model" / "model.pt")
    # the first attempt holds in the training step after `hold` steps until the SIGTERM; the ranks agree and
    # save a step or two later (22 seen for 20): mid-epoch 1, and the last batch of epoch 1 (16 per epoch)
    for hold in (20, 30):
        name = f"preempted-{hold}"
        preempted = local_run(tmp_path, name, ["--preempt-after", f"{2 * elapsed + 10:.0f}", "--grace", "60"],
                              ["--hold-at-step", str(hold)])  # fmt: skip
        out = preempted.stdout
        assert preempted.returncode == 0, out[-5000:]
        assert "preemption notice: saving" in out and "restarting the whole job" in out, out[-5000:]
        assert f"resuming from {tmp_path / name / 'checkpoints'}/step_" in out, out[-5000:]
        assert "done: 48 steps" in out, out[-5000:]
        got = torch.load(tmp_path / name / "model" / "model.pt")
        assert all(torch.equal(expected[k], got[k]) for k in expected), name  # bitwise


def test_checkpoint_io_saves_the_same_step_twice_while_the_first_is_in_flight(tmp_path: Path) -> None:
    # ModelCheckpoint(save_last=True) saves 'epoch=0-step=7.ckpt' then 'last.ckpt' at one step; with the
    # default async_save the first save is still being written when the second asks whether step 7 exists.
    io = VertexCheckpointIO(str(tmp_path / "ckpt"))
    checkpoint = {"global_step": 7, "state_dict": {"w": torch.arange(3.0)}, "loops": {"x": [1, 2]}}
    io.save_checkpoint(checkpoint, tmp_path / "epoch=0-step=7.ckpt")
    io.save_checkpoint({**checkpoint, "loops": {"x": [3]}}, tmp_path / "last.ckpt")
    io.teardown()
    assert io.load_checkpoint(io.path_for(7))["loops"] == {"x": [3]}


@pytest.mark.slow
def test_fabric_job_saves_and_resumes_through_vertexrt_to_the_same_weights(tmp_path: Path) -> None:
    """``Fabric(plugins=[VertexEnvironment(), VertexCheckpointIO(...)])``, 2 replicas (DDP, gloo): 3 steps,
    then 3 more resumed from the checkpoint, end where 6 uninterrupted steps end."""

    def fabric(directory: str, steps: int) -> dict:
        script = Path(__file__).parent / "scripts" / "fabric_job.py"
        job = [sys.executable, str(script), str(tmp_path / directory), str(steps)]
        launcher = [sys.executable, "-m", "vertexrt.cli", "local-run", "--workers", "2", "--"]
        done = run_job([*launcher, *job], cwd=tmp_path, timeout=400)
        assert done.returncode == 0, done.stdout[-5000:]
        (line,) = [x for x in done.stdout.splitlines() if "RESULT " in x]
        return json.loads(line.split("RESULT ", 1)[1])

    first, resumed = fabric("split", 3), fabric("split", 3)
    whole = fabric("whole", 6)
    assert first["resumed_from"] is None and resumed["resumed_from"] == str(tmp_path / "split" / "step_3")
    assert resumed["step"] == whole["step"] == 6
    assert resumed["weights"] == whole["weights"]  # model and Adam state carried exactly


@pytest.mark.slow
def test_standalone_pytorch_lightning_trainer_takes_the_plugins_and_resumes_after_a_preemption(
    tmp_path: Path,
) -> None:
    """``pytorch_lightning.Trainer`` (the package many samples import; ``lightning`` ships it again as
    ``lightning.pytorch``) accepts ``vertex.plugins()`` and the callback: a SIGTERM saves and exits 143, the
    rerun resumes to the weights of an uninterrupted run; Lightning logs nothing about ``weights_only``."""
    pytest.importorskip("pytorch_lightning", reason="the standalone pytorch_lightning is not installed")
    script = Path(__file__).parent / "scripts" / "pl_standalone_job.py"
    env = {
        k: v for k, v in os.environ.items() if k not in ("CLUSTER_SPEC", "TF_CONFIG", "RANK", "WORLD_SIZE")
    }

    def job(directory: str, sigterm_at: int) -> subprocess.CompletedProcess[str]:
        env["VERTEXRT_LOCAL_DIR"] = str(tmp_path / directory)
        return run_job([sys.executable, str(script), str(sigterm_at)], cwd=tmp_path, timeout=120, env=env)

    def result(done: subprocess.CompletedProcess[str]) -> dict:
        assert done.returncode == 0, done.stdout[-3000:]
        (line,) = [x for x in done.stdout.splitlines() if x.startswith("RESULT ")]
        return json.loads(line[len("RESULT ") :])

    preempted = job("split", sigterm_at=2)
    assert preempted.returncode == 143, preempted.stdout[-3000:]
    assert "weights_only" not in preempted.stdout
    resumed, whole = result(job("split", 0)), result(job("whole", 0))
    # the module's hook runs after the callback's: the notice is seen at the next batch end, step 3
    assert resumed["resumed_from"] == str(tmp_path / "split" / "checkpoints" / "step_3")
    assert resumed["step"] == whole["step"] == 6
    assert resumed["weights"] == whole["weights"]

"""local-run behaves as Vertex and container runtimes do: SIGTERM to each replica's main process only, no
restart of a job whose replicas all exited 0, and a bare ``python`` is the launcher's own interpreter."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from vertexrt.distributed.launcher import with_this_python

pytestmark = pytest.mark.slow


def test_the_notice_reaches_the_main_process_only(local_run) -> None:
    # killpg would end the replica's child (a DataLoader worker) with the notice, before any save
    run = local_run(
        "--preempt-after",
        "3",
        "--restarts",
        "0",
        "--grace",
        "10",
        "--",
        "behave.py",
        "notice_with_child",
        timeout=60,
    )
    assert "child alive after the notice" in run.output, run.output
    assert "workerpool0-0 exited with code 143" in run.output


def test_a_job_whose_replicas_all_exit_0_after_the_notice_is_not_restarted(local_run) -> None:
    run = local_run(
        "--workers", "2", "--preempt-after", "3", "--", "behave.py", "finish_on_notice", timeout=90
    )
    assert run.returncode == 0, run.output
    assert run.output.count("notice: finishing, exit 0") == 2, run.output
    assert "restarting" not in run.output
    assert "every replica exited 0 after the notice: the job finished, no restart" in run.output


def test_a_bare_python_is_the_launchers_interpreter(local_run, tmp_path: Path) -> None:
    impostor = tmp_path / "bin"
    impostor.mkdir()
    for name in ("python", "python3"):
        (impostor / name).write_text('#!/bin/sh\necho \'RESULT {"python": "from PATH"}\'\n')
        (impostor / name).chmod(0o755)
    env = {"PATH": f"{impostor}{os.pathsep}{os.environ['PATH']}"}
    code = "import json, sys; print('RESULT ' + json.dumps({'python': sys.executable}))"
    run = local_run("--", "python", "-c", code, env=env, timeout=60)
    assert run.returncode == 0, run.output
    assert run.results() == {"workerpool0-0": {"python": sys.executable}}


def test_only_a_bare_python_is_replaced() -> None:
    assert with_this_python(["python3", "t.py"]) == [sys.executable, "t.py"]
    assert with_this_python(["/usr/bin/python3", "t.py"]) == ["/usr/bin/python3", "t.py"]
    assert with_this_python(["bash", "-c", "python t.py"]) == ["bash", "-c", "python t.py"]


def test_a_lost_vm_loses_its_local_disk_and_the_others_keep_theirs(local_run) -> None:
    run = local_run("--workers", "3", "--lose-vm", "workerpool1-0@5", "--", "local_disk.py", timeout=90)
    assert run.returncode == 0, run.output
    before_loss = run.output.partition("the VM of workerpool1-0 is lost")[0]
    assert before_loss.count("] ready") == 3, run.output  # every replica wrote to its disk before the loss
    assert "SIGKILL with no grace, its local disk wiped" in run.output
    assert "workerpool1-0 exited with code 137" in run.output
    assert "restarting the whole job (restart 1 of 1)" in run.output
    restarted = run.results()  # each replica's last report: the second attempt's
    assert {label: r["attempt"] for label, r in restarted.items()} == {
        "workerpool0-0": 2,
        "workerpool1-0": 2,
        "workerpool1-1": 2,
    }
    assert restarted["workerpool1-0"]["files"] == []
    assert restarted["workerpool0-0"]["files"] == restarted["workerpool1-1"]["files"] == ["attempt-1"]
    disks = {r["disk"] for r in restarted.values()}
    assert len(disks) == 3  # a disk per replica
    assert not any(Path(d).exists() for d in disks)  # and gone with the job, as a VM's


def test_lose_vm_names_a_training_replica_of_the_job(local_run) -> None:
    run = local_run("--workers", "2", "--lose-vm", "workerpool1-5@1", "--", "local_disk.py", timeout=30)
    assert run.returncode == 2
    assert "--lose-vm workerpool1-5@1: no such training replica" in run.output
    assert "choose one of workerpool0-0, workerpool1-0" in run.output

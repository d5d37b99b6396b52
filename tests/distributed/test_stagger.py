"""``local-run --stagger``: replicas come up seconds apart, the chief last, and the workers wait for it
(patient rendezvous) instead of failing; torch and TensorFlow."""

from __future__ import annotations

import pytest

from .test_torch import check_all_reduce

pytestmark = pytest.mark.slow


def test_torch_workers_wait_for_a_chief_that_starts_last(local_run) -> None:
    run = local_run("--workers", "3", "--stagger", "3", "--", "patient.py", "torch", timeout=60)
    assert run.returncode == 0, run.output
    check_all_reduce(run.records(), 3)
    assert (
        "[workerpool1-0] vertexrt.distributed.rendezvous: waiting for the chief at 127.0.0.1:" in run.output
    )
    assert "[workerpool1-0] vertexrt.distributed.rendezvous: the chief at 127.0.0.1:" in run.output
    # the first worker started 6 s before the chief (a slow interpreter start may reorder the others' lines)
    assert run.output.index("[workerpool1-0]") < run.output.index("[workerpool0-0]")


def test_tensorflow_workers_wait_for_a_chief_that_starts_last(local_run) -> None:
    pytest.importorskip("tensorflow")
    run = local_run("--workers", "2", "--stagger", "6", "--", "patient.py", "tf", timeout=60)
    assert run.returncode == 0, run.output
    chief, worker = run.results()["workerpool0-0"], run.results()["workerpool1-0"]
    assert chief["is_multi_worker"] and chief["weights"] == worker["weights"]
    assert (
        "[workerpool1-0] vertexrt.distributed.rendezvous: waiting for the chief at 127.0.0.1:" in run.output
    )


def test_a_signal_during_the_stagger_stops_the_job_before_the_chief_starts(local_run) -> None:
    # The launcher used to sleep out the whole stagger (up to an hour) and start the chief after a Ctrl-C.
    script = 'echo "up as $RANK"; sleep 300'
    run = local_run(
        "--workers",
        "2",
        "--stagger",
        "40",
        "--",
        "bash",
        "-c",
        script,
        timeout=20,
        stop_when="up as 1",
    )
    assert run.returncode == 128 + 15, run.output
    assert "[workerpool0-0]" not in run.output
    assert "job interrupted" in run.output


def test_a_worker_failing_during_the_stagger_fails_the_job_before_the_chief_starts(local_run) -> None:
    script = 'if [ "$RANK" = 1 ]; then exit 3; fi; echo chief started'
    run = local_run("--workers", "2", "--stagger", "40", "--", "bash", "-c", script, timeout=20)
    assert run.returncode == 3, run.output
    assert "chief started" not in run.output
    assert "workerpool1-0 failed" in run.output

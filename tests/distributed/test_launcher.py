"""local-run: the environment each replica gets, and real process trees (exit codes, teardown, preemption)."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import warnings

import pytest

from vertexrt.distributed import cluster
from vertexrt.distributed.launcher import (
    DATA_VARIABLES,
    JobSpec,
    add_arguments,
    data_variables,
    main,
    port_count,
    replica_environments,
)


def environments(job: JobSpec, parent: dict[str, str] | None = None):
    return replica_environments(job, parent or {}, list(range(41000, 41000 + port_count(job))))


def test_single_replica_gets_only_cluster_spec_and_job_variables(tmp_path) -> None:
    (chief,) = environments(JobSpec(["python"], base_output_dir=str(tmp_path / "out"), job_id="42"))
    env = chief.env
    assert "TF_CONFIG" not in env and "MASTER_ADDR" not in env and "RANK" not in env
    assert cluster(env).source == "CLUSTER_SPEC" and cluster(env).world_size == 1
    assert env["AIP_MODEL_DIR"] == f"{tmp_path}/out/model/" and env["AIP_CHECKPOINT_DIR"].endswith(
        "/checkpoints/"
    )
    assert env["CLOUD_ML_JOB_ID"] == "42" and "CLOUD_ML_TRIAL_ID" not in env


def test_multi_replica_environment_is_what_vertex_gives(tmp_path) -> None:
    parent = {"RANK": "9", "AIP_MODEL_DIR": "gs://stale/", "CLOUD_ML_TRIAL_ID": "99", "HOME": "/root"}
    job = JobSpec(["python"], workers=3, evaluators=1, trial="3", base_output_dir="gs://b/base", job_id="7")
    replicas = environments(job, parent)
    assert [r.label for r in replicas] == ["workerpool0-0", "workerpool1-0", "workerpool1-1", "workerpool3-0"]
    for replica in replicas:
        env = replica.env
        assert env["HOME"] == "/root" and env["CLOUD_ML_TRIAL_ID"] == "3" and env["VERTEXRT_LOCAL_RUN"] == "1"
        assert env["AIP_MODEL_DIR"] == "gs://b/base/3/model/"
        assert json.loads(env["CLUSTER_SPEC"])["task"]["trial"] == "3"
        tf_config = json.loads(env["TF_CONFIG"])
        assert "evaluator" not in tf_config["cluster"] and len(tf_config["cluster"]["worker"]) == 2
        assert env["MASTER_ADDR"] == "127.0.0.1" and env["WORLD_SIZE"] == "3"
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # CLUSTER_SPEC, TF_CONFIG and RANK agree
            c = cluster(env)
        assert c.trial_id == "3"
    ranks = [cluster(r.env).rank for r in replicas]
    assert ranks == [0, 1, 2, -1] and [r.env.get("RANK") for r in replicas] == ["0", "1", "2", None]


def test_parameter_servers_and_reduction_server() -> None:
    ps = environments(JobSpec(["python"], workers=2, ps=2))
    assert [r.label for r in ps] == ["workerpool0-0", "workerpool1-0", "workerpool2-0", "workerpool2-1"]
    assert json.loads(ps[0].env["TF_CONFIG"])["cluster"]["ps"] and cluster(ps[2].env).role == "ps"
    rs = environments(JobSpec(["python"], workers=2, reduction_servers=1))
    assert [(r.label, r.runs) for r in rs] == [
        ("workerpool0-0", True),
        ("workerpool1-0", True),
        ("workerpool2-0", False),
    ]
    assert "ps" not in json.loads(rs[0].env["TF_CONFIG"])["cluster"]
    assert cluster(rs[1].env).pool("reduction_server") is not None


def test_processes_per_node_get_torchrun_variables() -> None:
    replicas = environments(JobSpec(["python"], workers=2, processes_per_node=2))
    assert [r.label for r in replicas] == [
        "workerpool0-0/0",
        "workerpool0-0/1",
        "workerpool1-0/0",
        "workerpool1-0/1",
    ]
    clusters = [cluster(r.env) for r in replicas]
    assert [(c.rank, c.world_size, c.local_rank, c.node_rank) for c in clusters] == [
        (0, 4, 0, 0),
        (1, 4, 1, 0),
        (2, 4, 0, 1),
        (3, 4, 1, 1),
    ]
    assert {c.source for c in clusters} == {"torchrun"} and len({c.rendezvous_address for c in clusters}) == 1


def test_bad_arguments_exit_2(capsys) -> None:
    assert main(["--workers", "2"]) == 2
    assert main(["--ps", "1", "--reduction-server", "--", "python"]) == 2
    assert "workerpool2" in capsys.readouterr().err
    assert main(["--", "/nonexistent/train"]) == 2
    assert "cannot start '/nonexistent/train' for workerpool0-0" in capsys.readouterr().err


@pytest.mark.parametrize("flag", ["--grace", "--preempt-after", "--stagger"])
@pytest.mark.parametrize("value", ["nan", "inf", "-1"])
def test_seconds_flags_refuse_values_that_are_not_a_duration(flag: str, value: str, capsys) -> None:
    # `--grace nan` used to be accepted: the teardown then waited nan seconds (no grace at all).
    with pytest.raises(SystemExit) as exit_:
        main([flag, value, "--", "python", "-c", "pass"])
    assert exit_.value.code == 2
    assert f"{flag}: expected a finite number of seconds >= 0, got {value!r}" in capsys.readouterr().err


def test_help_runs_as_a_module() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "vertexrt.distributed.launcher", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0 and "--preempt-after" in out.stdout


@pytest.mark.slow
def test_replicas_see_their_environment_and_output_is_prefixed(local_run, tmp_path) -> None:
    run = local_run(
        "--workers",
        "2",
        "--trial",
        "5",
        "--base-output-dir",
        str(tmp_path / "base"),
        "--",
        "behave.py",
        "env",
        timeout=60,
    )
    assert run.returncode == 0, run.output
    results = run.results()
    assert set(results) == {"workerpool0-0", "workerpool1-0"}
    assert results["workerpool1-0"]["cluster"] == {"rank": 1, "world_size": 2, "role": "worker", "trial": "5"}
    assert results["workerpool0-0"]["AIP_CHECKPOINT_DIR"] == f"{tmp_path}/base/5/checkpoints/"
    assert results["workerpool0-0"]["CLOUD_ML_JOB_ID"] == results["workerpool1-0"]["CLOUD_ML_JOB_ID"]


@pytest.mark.slow
def test_chief_failure_tears_down_workers_that_ignore_sigterm(local_run) -> None:
    run = local_run("--workers", "3", "--", "behave.py", "fail_chief", "7", timeout=60)
    assert run.returncode == 7, run.output
    assert "the chief replica workerpool0-0 failed: tearing down" in run.output
    assert "workerpool1-0 ignored SIGTERM: SIGKILLed after the 3 s grace" in run.output


@pytest.mark.slow
def test_worker_failure_fails_the_job(local_run) -> None:
    run = local_run("--workers", "2", "--", "behave.py", "fail_worker", "5", timeout=60)
    assert run.returncode == 5, run.output
    assert "replica workerpool1-0 failed" in run.output


@pytest.mark.slow
def test_job_succeeds_with_the_chief_and_the_rest_is_shut_down(local_run) -> None:
    run = local_run(
        "--workers", "2", "--evaluator", "--grace", "1", "--", "behave.py", "chief_done", timeout=60
    )
    assert run.returncode == 0, run.output
    assert "job succeeded" in run.output
    assert "workerpool1-0 ignored SIGTERM: SIGKILLed after the 1 s grace" in run.output


@pytest.mark.slow
def test_preemption_restarts_the_whole_job(local_run) -> None:
    run = local_run("--workers", "2", "--preempt-after", "4", "--", "behave.py", "preempt", timeout=90)
    assert run.returncode == 0, run.output
    assert run.output.count("got SIGTERM, saving") == 2  # both replicas were told, and had time to save
    assert "restarting the whole job (restart 1 of 1)" in run.output
    assert run.results() == {"workerpool0-0": {"attempt": 2}, "workerpool1-0": {"attempt": 2}}
    # the preempted attempt says how each replica ended (behave.py exits 143 after saving)
    assert "workerpool0-0 exited with code 143" in run.output
    assert "workerpool1-0 exited with code 143" in run.output


@pytest.mark.slow
def test_failure_with_restarts_reruns_then_reports_the_chief(local_run) -> None:
    run = local_run(
        "--workers", "2", "--restarts", "1", "--grace", "1", "--", "behave.py", "fail_chief", "6", timeout=90
    )
    assert run.returncode == 6, run.output
    assert run.output.count("the chief replica workerpool0-0 failed") == 2


@pytest.mark.slow
def test_stopping_the_launcher_tears_everything_down(local_run) -> None:
    run = local_run("--workers", "2", "--", "behave.py", "sleep", timeout=60, stop_when="sleeping")
    assert run.returncode == 128 + 15, run.output
    assert "received signal 15" in run.output


def test_managed_dataset_flags_and_the_shell_reach_every_replica(tmp_path, capsys) -> None:
    args = argparse.ArgumentParser()
    add_arguments(args)
    parsed = args.parse_args(["--training-data", "gs://b/train-*.jsonl", "--data-format", "jsonl", "--", "x"])
    shell = {"AIP_VALIDATION_DATA_URI": "gs://b/val.jsonl", "AIP_TRAINING_DATA_URI": "gs://stale/"}
    data = data_variables(parsed, shell)
    assert data == {
        "AIP_TRAINING_DATA_URI": "gs://b/train-*.jsonl",  # the flag wins over the shell
        "AIP_VALIDATION_DATA_URI": "gs://b/val.jsonl",
        "AIP_DATA_FORMAT": "jsonl",
    }
    assert "passing AIP_VALIDATION_DATA_URI=gs://b/val.jsonl from your environment" in capsys.readouterr().err
    job = JobSpec(["python"], workers=2, data=data, base_output_dir=str(tmp_path))
    for replica in environments(job, {**shell, "AIP_TEST_DATA_URI": "gs://not-passed/"}):
        assert {k: v for k, v in replica.env.items() if k in DATA_VARIABLES.values()} == data


def test_each_job_and_trial_gets_its_own_hypertune_file(tmp_path) -> None:
    def metric_file(**spec) -> set[str]:
        return {
            r.env["CLOUD_ML_HP_METRIC_FILE"] for r in environments(JobSpec(["python"], workers=2, **spec))
        }

    (one,) = metric_file(job_id="1", base_output_dir=str(tmp_path))
    (trial,) = metric_file(job_id="1", trial="4", base_output_dir=str(tmp_path))
    (other,) = metric_file(job_id="2")
    assert one == f"{tmp_path}/hypertune/output.metrics" and trial == f"{tmp_path}/4/hypertune/output.metrics"
    assert other.endswith("vertexrt_output/2/hypertune/output.metrics") and other.startswith("/")
    (remote,) = metric_file(job_id="3", trial="1", base_output_dir="gs://b/out")  # reports stay local
    assert remote.endswith("vertexrt_output/3/1/hypertune/output.metrics") and remote.startswith("/")
    chosen = environments(JobSpec(["python"]), {"CLOUD_ML_HP_METRIC_FILE": "/mine"})[0]
    assert chosen.env["CLOUD_ML_HP_METRIC_FILE"] == "/mine"  # the user's own choice is kept


def test_on_chief_replica_means_the_chief_pool_not_the_chief_process() -> None:
    replicas = environments(JobSpec(["python"], workers=2, processes_per_node=2))
    assert [r.on_chief_replica for r in replicas] == [True, True, False, False]
    assert [cluster(r.env).is_chief for r in replicas] == [True, False, False, False]
    assert not hasattr(replicas[0], "is_chief")


@pytest.mark.slow
def test_a_managed_dataset_job_can_be_simulated(local_run, monkeypatch) -> None:
    monkeypatch.setenv("AIP_TEST_DATA_URI", "gs://b/test.csv")
    script = 'echo "data $AIP_TRAINING_DATA_URI $AIP_TEST_DATA_URI $AIP_DATA_FORMAT"'
    run = local_run("--training-data", "gs://b/train.csv", "--data-format", "csv", "--", "sh", "-c", script)
    assert run.returncode == 0, run.output
    assert "[workerpool0-0] data gs://b/train.csv gs://b/test.csv csv" in run.output
    assert "passing AIP_TEST_DATA_URI=gs://b/test.csv from your environment" in run.output

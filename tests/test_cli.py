"""`vertexrt info` on simulated jobs, with the warnings users need."""

from __future__ import annotations

import json

import pytest
from jobs import run_job, start_job

from vertexrt import cli


def _info(capsys, *args: str) -> str:
    assert cli.main(["info", *args]) == 0
    return capsys.readouterr().out


def test_info_json_for_a_simulated_vertex_job(vertex_env, capsys):
    vertex_env(trial="2", base_output_dir="gs://my-bucket/base", workers=1)
    report = json.loads(_info(capsys, "--json"))
    env = report["environment"]
    assert env["on_vertex"] is True and env["project"] == "123456789012" and env["trial_id"] == "2"
    assert env["model_dir"] == "gs://my-bucket/base/2/model"
    assert report["variables"]["CLOUD_ML_JOB_ID"] == "1234567890"
    assert report["warnings"] == []


def test_info_table(vertex_env, capsys):
    vertex_env(base_output_dir="gs://my-bucket/base")
    out = _info(capsys)
    assert "model_dir" in out and "gs://my-bucket/base/model" in out and "CLOUD_ML_JOB_ID=1234567890" in out


def test_info_local_run(clean_env, monkeypatch, capsys):
    monkeypatch.setenv("GOOGLE_CLOUD_PROJECT", "p")
    out = _info(capsys)
    assert "a local run" in out and "warning" not in out


def test_warns_aip_dir_not_gcs_on_vertex(vertex_env, capsys):
    vertex_env(extra={"AIP_MODEL_DIR": "/tmp/model/"})
    out = _info(capsys)
    assert "warning: AIP_MODEL_DIR='/tmp/model/' is neither a gs:// URI nor a /gcs/ path" in out


def test_fuse_output_dirs_are_fine_on_vertex(vertex_env, capsys):
    vertex_env(
        extra={
            "AIP_MODEL_DIR": "/gcs/my-bucket/base/model/",
            "AIP_CHECKPOINT_DIR": "/gcs/my-bucket/base/checkpoints/",
            "AIP_TENSORBOARD_LOG_DIR": "/gcs/my-bucket/base/logs/",
        }
    )
    assert "warning" not in _info(capsys)


def test_warns_missing_output_dirs_on_vertex(vertex_env, capsys):
    vertex_env()
    assert "AIP_CHECKPOINT_DIR is not set" in _info(capsys)


@pytest.mark.parametrize("name", ["CLUSTER_SPEC", "TF_CONFIG"])
def test_malformed_json_reaches_info_as_a_warning(vertex_env, monkeypatch, capsys, name):
    vertex_env(base_output_dir="gs://my-bucket/base")
    monkeypatch.setenv(name, '{"cluster": ')
    out = _info(capsys)
    assert f"{name} is not valid JSON" in out


def test_tf_config_and_cluster_spec_disagreeing(vertex_env, monkeypatch, capsys):
    vertex_env(base_output_dir="gs://my-bucket/base", workers=1, task=("workerpool1", 0))
    monkeypatch.setenv(
        "TF_CONFIG",
        json.dumps(
            {
                "cluster": {"chief": ["other-host:2222"], "worker": ["w:2222"]},
                "task": {"type": "chief", "index": 0},
            }
        ),
    )
    report = json.loads(_info(capsys, "--json"))
    text = "\n".join(report["warnings"])
    assert "CLUSTER_SPEC lists {'chief': ('cmle-training-workerpool0-ab12cd34ef-0:2222',)" in text
    assert "but TF_CONFIG lists {'chief': ('other-host:2222',)" in text
    assert "CLUSTER_SPEC says this task is worker 0 but TF_CONFIG says chief 0" in text
    assert report["cluster"]["source"] == "CLUSTER_SPEC"  # CLUSTER_SPEC wins


def test_project_not_resolvable_warns(vertex_env, monkeypatch, capsys):
    vertex_env(base_output_dir="gs://my-bucket/base")
    monkeypatch.delenv("CLOUD_ML_PROJECT_ID")
    assert "project not resolvable" in _info(capsys)


def test_bad_aip_value_does_not_crash_info(vertex_env, capsys):
    vertex_env(extra={"AIP_CHECKPOINT_DIR": ""})
    out = _info(capsys)
    assert "warning: AIP_CHECKPOINT_DIR is set but empty" in out


def test_gcs_server_command_prints_exports_and_serves(tmp_path):
    import os
    import signal
    import sys
    import urllib.request

    env = dict(os.environ, PYTHONUNBUFFERED="1")
    command = [sys.executable, "-m", "vertexrt.cli", "gcs-server", "--bucket", "cli-bucket"]
    with start_job(command, env=env, merge_stderr=False) as job:
        try:
            first = job.wait_for(lambda out: "\n" in out, timeout=120).splitlines()[0].strip()
            assert first.startswith("export STORAGE_EMULATOR_HOST=http://127.0.0.1:")
            endpoint = first.split("=", 1)[1]
            with urllib.request.urlopen(f"{endpoint}/storage/v1/b/cli-bucket", timeout=5) as reply:
                assert json.loads(reply.read())["name"] == "cli-bucket"
        finally:
            job.signal(signal.SIGTERM)
            assert job.wait(10).returncode == 0


# -- info reports, never crashes; it never prints credentials ------------------------------------------

_DEEP = '{"a":' * 20_000 + "1" + "}" * 20_000
_HUGE = "9" * 5000


@pytest.mark.parametrize(
    ("name", "variables"),
    [
        ("TF_CONFIG", {"TF_CONFIG": _DEEP}),
        ("CLUSTER_SPEC", {"CLUSTER_SPEC": _DEEP}),
        ("RANK", {"MASTER_ADDR": "h", "MASTER_PORT": "2222", "WORLD_SIZE": "2", "RANK": _HUGE}),
        ("MASTER_PORT", {"MASTER_ADDR": "h", "MASTER_PORT": _HUGE, "WORLD_SIZE": "2", "RANK": "0"}),
        ("GOOGLE_APPLICATION_CREDENTIALS", {"GOOGLE_APPLICATION_CREDENTIALS": "DIR"}),
        ("GOOGLE_APPLICATION_CREDENTIALS", {"GOOGLE_APPLICATION_CREDENTIALS": "LIST"}),
    ],
    ids=[
        "deep-tf-config",
        "deep-cluster-spec",
        "huge-rank",
        "huge-port",
        "credentials-dir",
        "credentials-list",
    ],
)
def test_info_survives_hostile_environment(tmp_path, name, variables):
    import os
    import sys

    (tmp_path / "list.json").write_text("[1]")
    paths = {"DIR": str(tmp_path), "LIST": str(tmp_path / "list.json")}
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AIP_", "CLOUD_ML_", "GOOGLE_"))}
    for key in ("TF_CONFIG", "CLUSTER_SPEC", "MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK"):
        env.pop(key, None)
    env |= {k: paths.get(v, v) for k, v in variables.items()}
    for args in (["info"], ["info", "--json"]):
        done = run_job([sys.executable, "-m", "vertexrt.cli", *args], tmp_path, 60, env, merge_stderr=False)
        assert done.returncode == 0, done.stderr[-2000:]
        assert "Traceback" not in done.stderr
        if "--json" in args:
            warnings = json.loads(done.stdout)["warnings"]
        else:
            warnings = [line for line in done.stdout.splitlines() if line.startswith("warning:")]
        assert any(name in warning for warning in warnings), done.stdout[-2000:]


def test_info_masks_credentials_in_uris(vertex_env, capsys):
    vertex_env(
        base_output_dir="gs://my-bucket/base",
        extra={
            "AIP_TRAINING_DATA_URI": "https://storage.googleapis.com/b/o?X-Goog-Signature=s3cr3t&alt=media",
            "AIP_TEST_DATA_URI": "gs://user:hunter2@my-bucket/test",
        },
    )
    for args in ((), ("--json",)):
        out = _info(capsys, *args)
        assert "s3cr3t" not in out and "hunter2" not in out
        assert "X-Goog-Signature=***" in out


def test_local_run_simulation_is_not_warned_about_local_outputs(vertex_env, tmp_path, capsys):
    base = tmp_path / "vertexrt_output" / "local-run-1"
    vertex_env(
        extra={
            "VERTEXRT_LOCAL_RUN": "1",
            "AIP_MODEL_DIR": f"{base}/model/",
            "AIP_CHECKPOINT_DIR": f"{base}/checkpoints/",
            "AIP_TENSORBOARD_LOG_DIR": f"{base}/logs/",
        }
    )
    out = _info(capsys)
    assert "lost" not in out and "warning" not in out
    assert "note: a `vertexrt local-run` simulation of a Vertex job" in out
    assert json.loads(_info(capsys, "--json"))["local_run"] is True


def test_doctor_rejects_a_bad_timeout(capsys):
    assert cli.main(["doctor", "--timeout", "0"]) == 2
    assert "--timeout 0" in capsys.readouterr().err

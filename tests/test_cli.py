"""`vertexrt info` on simulated jobs, with the warnings users need."""

from __future__ import annotations

import json

import pytest

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
    import subprocess
    import sys
    import urllib.request

    env = dict(os.environ, PYTHONUNBUFFERED="1")
    command = [sys.executable, "-m", "vertexrt.cli", "gcs-server", "--bucket", "cli-bucket"]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, text=True, env=env)
    try:
        first = process.stdout.readline().strip()
        assert first.startswith("export STORAGE_EMULATOR_HOST=http://127.0.0.1:")
        endpoint = first.split("=", 1)[1]
        with urllib.request.urlopen(f"{endpoint}/storage/v1/b/cli-bucket", timeout=5) as reply:
            assert json.loads(reply.read())["name"] == "cli-bucket"
    finally:
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=10) == 0

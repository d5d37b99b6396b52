"""The platform contract as vertexrt.environment() and project_id() read it."""

from __future__ import annotations

import os

import pytest

import vertexrt
from vertexrt.errors import ConfigError


def test_local_run_falls_back_to_local_layout(clean_env, tmp_path):
    env = vertexrt.environment()
    base = str(tmp_path / "vertexrt_output")
    assert env.platform == "local" and not env.on_vertex
    assert (env.model_dir, env.checkpoint_dir, env.tensorboard_log_dir) == (
        f"{base}/model",
        f"{base}/checkpoints",
        f"{base}/logs",
    )
    assert env.job_id is None and env.trial_id is None and env.variables.get("CLOUD_ML_JOB_ID") is None


def test_default_local_base_is_named_after_the_job(clean_env, monkeypatch, tmp_path):
    monkeypatch.delenv("VERTEXRT_LOCAL_DIR")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("CLOUD_ML_TRIAL_ID", "4")
    assert vertexrt.environment().model_dir == f"{tmp_path}/vertexrt_output/local/4/model"


def test_simulated_vertex_job_with_trial(vertex_env):
    vertex_env(trial="3", base_output_dir="gs://my-bucket/base/", workers=2, task=("workerpool1", 1))
    env = vertexrt.environment()
    assert env.on_vertex and env.platform == "vertex"
    assert env.project == "123456789012" and env.region == "us-central1" and env.job_id == "1234567890"
    assert env.trial_id == "3"
    assert env.model_dir == "gs://my-bucket/base/3/model"
    assert env.checkpoint_dir == "gs://my-bucket/base/3/checkpoints"
    assert env.tensorboard_log_dir == "gs://my-bucket/base/3/logs"
    assert env.variables["RANK"] == "2"


def test_vertex_job_without_base_output_dir_uses_local_layout_per_job(vertex_env, monkeypatch, tmp_path):
    vertex_env(job_id="777")
    monkeypatch.chdir(tmp_path)
    assert vertexrt.environment().model_dir == f"{tmp_path}/vertexrt_output/777/model"


def test_trial_from_cluster_spec_when_variable_missing(vertex_env):
    vertex_env(trial="5")
    os.environ.pop("CLOUD_ML_TRIAL_ID")
    assert vertexrt.environment().trial_id == "5"


def test_data_uris_and_format(clean_env, monkeypatch):
    monkeypatch.setenv("AIP_DATA_FORMAT", "JSONL")
    monkeypatch.setenv("AIP_TRAINING_DATA_URI", "gs://b/dataset-1/training-*.jsonl")
    monkeypatch.setenv("AIP_VALIDATION_DATA_URI", "bq://p.d.validation")
    env = vertexrt.environment()
    assert env.data_format == "jsonl"
    assert env.training_data_uri == "gs://b/dataset-1/training-*.jsonl"
    assert env.validation_data_uri == "bq://p.d.validation" and env.test_data_uri is None


def test_legacy_ai_platform_master_and_job_dir(clean_env, monkeypatch):
    monkeypatch.setenv(
        "TF_CONFIG",
        '{"cluster": {"master": ["cmle-training-master-e1-0:2222"]}, "task": {"type": "master", "index": 0},'
        ' "environment": "cloud"}',
    )
    monkeypatch.setattr("sys.argv", ["task.py", "--job-dir", "gs://legacy-bucket/job/", "--lr=0.1"])
    env = vertexrt.environment()
    assert env.platform == "ai-platform" and env.on_vertex
    assert env.job_dir == "gs://legacy-bucket/job"
    assert env.model_dir == "gs://legacy-bucket/job/model"


def test_job_dir_equals_form(clean_env, monkeypatch):
    monkeypatch.setattr("sys.argv", ["task.py", "--job-dir=/tmp/jobdir"])
    assert vertexrt.environment().job_dir == "/tmp/jobdir"


@pytest.mark.parametrize("value", ["", "   "])
def test_empty_aip_value_names_the_variable(clean_env, monkeypatch, value):
    monkeypatch.setenv("AIP_CHECKPOINT_DIR", value)
    with pytest.raises(ConfigError, match="AIP_CHECKPOINT_DIR"):
        vertexrt.environment()


def test_relative_aip_value_names_the_variable(clean_env, monkeypatch):
    monkeypatch.setenv("AIP_MODEL_DIR", "model/")
    with pytest.raises(ConfigError, match=r"AIP_MODEL_DIR='model/'"):
        vertexrt.environment()


def test_bad_bucket_in_aip_value(clean_env, monkeypatch):
    monkeypatch.setenv("AIP_TENSORBOARD_LOG_DIR", "gs://Bad_Bucket/logs/")
    with pytest.raises(ConfigError, match="AIP_TENSORBOARD_LOG_DIR.*Bad_Bucket"):
        vertexrt.environment()


def test_job_dir_without_value(clean_env, monkeypatch):
    monkeypatch.setattr("sys.argv", ["task.py", "--job-dir"])
    with pytest.raises(ConfigError, match="--job-dir"):
        vertexrt.environment()


def test_read_at_call_time_not_cached(clean_env, monkeypatch):
    assert vertexrt.environment().job_id is None
    monkeypatch.setenv("CLOUD_ML_JOB_ID", "42")
    assert vertexrt.environment().job_id == "42"


# -- project resolver ---------------------------------------------------------------------------------


def test_project_explicit_wins(vertex_env):
    vertex_env()
    assert vertexrt.project_id("my-project") == "my-project"


def test_project_from_cloud_ml_project_id_is_a_number(vertex_env, monkeypatch):
    vertex_env(project="987654321")
    monkeypatch.setenv("GOOGLE_CLOUD_PROJECT", "something-else")
    assert vertexrt.project_id() == "987654321"


def test_on_vertex_never_falls_back_to_adc(vertex_env, monkeypatch):
    vertex_env()
    monkeypatch.delenv("CLOUD_ML_PROJECT_ID")
    monkeypatch.setenv("GOOGLE_CLOUD_PROJECT", "tenant-guess")
    with pytest.raises(ConfigError, match="tenant project"):
        vertexrt.project_id()


def test_off_vertex_uses_google_cloud_project_then_gcloud(clean_env, monkeypatch):
    monkeypatch.setenv("CLOUDSDK_CORE_PROJECT", "from-gcloud")
    assert vertexrt.project_id() == "from-gcloud"
    monkeypatch.setenv("GOOGLE_CLOUD_PROJECT", "from-env")
    assert vertexrt.project_id() == "from-env"


def test_unresolvable_project_says_what_to_set(clean_env, monkeypatch, tmp_path):
    monkeypatch.setenv("GOOGLE_APPLICATION_CREDENTIALS", str(tmp_path / "missing.json"))
    with pytest.raises(ConfigError, match="GOOGLE_CLOUD_PROJECT"):
        vertexrt.project_id()


def test_empty_cloud_ml_project_id(clean_env, monkeypatch):
    monkeypatch.setenv("CLOUD_ML_PROJECT_ID", "")
    with pytest.raises(ConfigError, match="CLOUD_ML_PROJECT_ID is set but empty"):
        vertexrt.project_id()
    with pytest.raises(ConfigError, match="CLOUD_ML_PROJECT_ID"):
        vertexrt.environment()


def test_empty_explicit_project(clean_env):
    with pytest.raises(ConfigError, match="empty"):
        vertexrt.project_id("  ")


# -- untrusted values are bounded; output directories stay where they belong ---------------------------


def _nested(depth: int) -> str:
    return '{"a":' * depth + "1" + "}" * depth


@pytest.mark.parametrize("name", ["TF_CONFIG", "CLUSTER_SPEC"])
def test_deeply_nested_json_does_not_crash_environment(clean_env, monkeypatch, name):
    monkeypatch.setenv(name, _nested(100_000))
    env = vertexrt.environment()  # was RecursionError; the cluster model reports malformed JSON
    assert env.trial_id is None


def test_oversized_values_are_a_config_error(clean_env, monkeypatch):
    monkeypatch.setenv("AIP_MODEL_DIR", "/tmp/" + "a" * 10_000)
    with pytest.raises(ConfigError, match="AIP_MODEL_DIR is 10005 characters long"):
        vertexrt.environment()


@pytest.mark.parametrize(
    "value", ["/gcs/bkt-1//var/x", "gs://bkt-1//var/x", "gs:/bkt-1/x", "/gcs/bkt-1/a/../../x"]
)
def test_output_dir_that_leaves_its_bucket_is_refused(clean_env, monkeypatch, value):
    monkeypatch.setenv("AIP_CHECKPOINT_DIR", value)
    with pytest.raises(ConfigError, match="AIP_CHECKPOINT_DIR"):
        vertexrt.environment()


def test_credentials_in_a_uri_are_not_echoed(clean_env, monkeypatch):
    monkeypatch.setenv("AIP_MODEL_DIR", "gs://user:hunter2@bkt-1/model")
    with pytest.raises(ConfigError, match="AIP_MODEL_DIR") as info:
        vertexrt.environment()
    assert "hunter2" not in str(info.value)


def test_repr_masks_signed_urls(clean_env, monkeypatch):
    monkeypatch.setenv("AIP_TRAINING_DATA_URI", "https://h/b/o?X-Goog-Signature=s3cr3t&alt=media")
    env = vertexrt.environment()
    assert env.training_data_uri.endswith("s3cr3t&alt=media")  # the value itself is usable
    assert "s3cr3t" not in repr(env) and "X-Goog-Signature=***" in repr(env)


@pytest.mark.parametrize("trial", ["../../etc", "a/b", "..", "x\ny"])
def test_trial_id_cannot_move_the_local_output_directory(clean_env, monkeypatch, tmp_path, trial):
    monkeypatch.setenv("CLOUD_ML_TRIAL_ID", trial)
    with pytest.raises(ConfigError, match="CLOUD_ML_TRIAL_ID"):
        vertexrt.environment()


def test_trial_from_cluster_spec_is_validated_too(vertex_env):
    vertex_env(trial="../../../tmp/elsewhere")
    os.environ.pop("CLOUD_ML_TRIAL_ID")
    with pytest.raises(ConfigError, match="CLUSTER_SPEC task.trial"):
        vertexrt.environment()


def test_job_id_cannot_move_the_local_output_directory(clean_env, monkeypatch):
    monkeypatch.delenv("VERTEXRT_LOCAL_DIR")
    monkeypatch.setenv("CLOUD_ML_JOB_ID", "../../outside")
    with pytest.raises(ConfigError, match="CLOUD_ML_JOB_ID"):
        vertexrt.environment()


def test_credentials_file_that_is_a_directory(clean_env, monkeypatch, tmp_path):
    monkeypatch.setenv("GOOGLE_APPLICATION_CREDENTIALS", str(tmp_path))
    with pytest.raises(ConfigError, match="GOOGLE_APPLICATION_CREDENTIALS=.*not a regular file"):
        vertexrt.project_id()


def test_credentials_file_holding_a_json_list(clean_env, monkeypatch, tmp_path):
    key = tmp_path / "key.json"
    key.write_text("[1, 2]")
    monkeypatch.setenv("GOOGLE_APPLICATION_CREDENTIALS", str(key))
    with pytest.raises(ConfigError, match="GOOGLE_APPLICATION_CREDENTIALS=.*JSON object"):
        vertexrt.project_id()


# -- one list of contract variables ---------------------------------------------------------------------


def test_platform_variables_are_the_ones_a_local_launch_drops():
    from vertexrt.env import CONTRACT_VARIABLES, SETTING_VARIABLES, is_platform_variable

    assert is_platform_variable("AIP_MODEL_DIR") and is_platform_variable("AIP_SOMETHING_NEW")
    assert is_platform_variable("CLUSTER_SPEC") and is_platform_variable("RANK")
    assert is_platform_variable("TORCHELASTIC_MAX_RESTARTS") and is_platform_variable("CLOUD_ML_JOB_ID")
    assert not is_platform_variable("CLOUD_ML_HP_METRIC_FILE")
    assert not is_platform_variable("GOOGLE_CLOUD_PROJECT") and not is_platform_variable("PATH")
    assert {n for n in CONTRACT_VARIABLES if not is_platform_variable(n)} == set(SETTING_VARIABLES)

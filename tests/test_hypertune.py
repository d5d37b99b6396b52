"""vertexrt.hypertune: byte-for-byte against cloudml-hypertune, chief-only, value checks, argument parsing."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from pathlib import Path

import hypertune as cloudml_hypertune
import pytest
from jobs import run_ranks

from vertexrt import hypertune
from vertexrt.errors import ConfigError, MetricError

FIXED_TIME = 1795306516.4312345


@pytest.fixture
def metric_env(tmp_path, monkeypatch):
    """A fresh metric file per test, a fixed clock, no trial/tag variables from the outside."""
    for name in ("CLOUD_ML_TRIAL_ID", "CLOUD_ML_HP_METRIC_TAG", "CLUSTER_SPEC", "TF_CONFIG", "RANK"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(time, "time", lambda: FIXED_TIME)
    monkeypatch.setattr(hypertune, "_queues", {})
    monkeypatch.setattr(hypertune, "_warned_tags", set())

    def use(name: str) -> Path:
        path = tmp_path / name / "output.metrics"
        monkeypatch.setenv("CLOUD_ML_HP_METRIC_FILE", str(path))
        return path

    return use


CALLS = [
    ("accuracy", 0.9, 1, ""),
    ("accuracy", 0.91, None, ""),
    ("accuracy", 0.92, 0, ""),
    ("loss", 3, 7, "gs://bucket/ckpt/7"),
    ("", 1e-9, 12.0, ""),  # empty tag -> training/hptuning/metric; float step
    ("accuracy", 0.1 + 0.2, 2**40, ""),  # repr-sensitive float, big step
    ("accuracy", -0.0, 3, ""),
]


def _ours(calls):
    for tag, value, step, ckpt in calls:
        assert hypertune.report(tag, value, step=step, checkpoint_path=ckpt) is True


def _theirs(calls):
    reporter = cloudml_hypertune.HyperTune()
    for tag, value, step, ckpt in calls:
        reporter.report_hyperparameter_tuning_metric(tag, value, global_step=step, checkpoint_path=ckpt)


@pytest.mark.parametrize("trial", [None, "3"])
def test_file_is_byte_for_byte_cloudml_hypertune(metric_env, monkeypatch, trial):
    if trial:
        monkeypatch.setenv("CLOUD_ML_TRIAL_ID", trial)
    theirs = metric_env("theirs")
    _theirs(CALLS)
    ours = metric_env("ours")
    _ours(CALLS)
    assert ours.read_bytes() == theirs.read_bytes()
    first = json.loads(ours.read_text().splitlines()[0])
    assert first == {
        "accuracy": "0.9",
        "checkpoint_path": "",
        "global_step": "1",
        "timestamp": FIXED_TIME,
        "trial": trial or "0",
    }


def test_numpy_and_torch_scalars_match(metric_env):
    np = pytest.importorskip("numpy")
    calls = [("auc", np.float32(0.75), np.int64(4), ""), ("auc", np.float64(0.5), 5, "")]
    theirs = metric_env("theirs")
    _theirs(calls)
    ours = metric_env("ours")
    _ours(calls)
    assert ours.read_bytes() == theirs.read_bytes()


def test_keeps_last_100_entries_across_calls(metric_env):
    calls = [("accuracy", i / 1000, i, "") for i in range(1, 151)]
    theirs = metric_env("theirs")
    _theirs(calls)
    ours = metric_env("ours")
    _ours(calls)
    assert ours.read_bytes() == theirs.read_bytes()
    lines = ours.read_text().splitlines()
    assert len(lines) == 100
    assert json.loads(lines[0])["global_step"] == "51"
    assert json.loads(lines[-1])["global_step"] == "150"


def test_default_file_location(monkeypatch):
    monkeypatch.delenv("CLOUD_ML_HP_METRIC_FILE", raising=False)
    assert hypertune.metric_file() == "/tmp/hypertune/output.metrics"


def test_bare_file_name_is_written_in_cwd(metric_env, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("CLOUD_ML_HP_METRIC_FILE", "metrics.jsonl")  # cloudml-hypertune crashes here
    hypertune.report("accuracy", 0.5)
    assert json.loads((tmp_path / "metrics.jsonl").read_text())["accuracy"] == "0.5"


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf"), "0.5", None, True, [1.0]])
def test_rejects_non_finite_and_non_numeric(metric_env, bad):
    path = metric_env("bad")
    with pytest.raises(ValueError, match="my_metric") as info:
        hypertune.report("my_metric", bad)
    assert isinstance(info.value, hypertune.MetricError)
    assert not path.exists()


@pytest.mark.parametrize(
    ("tag", "value", "step", "names"),
    [
        ("acc", 10**400, 1, "acc"),  # float() overflows
        ("acc", 0.5, float("nan"), "step"),
        ("acc", 0.5, float("inf"), "step"),
        ("acc", 0.5, "abc", "step"),
        ("acc", 0.5, [3], "step"),
        (123, 0.5, 1, "tag"),
        (b"acc", 0.5, 1, "tag"),
    ],
    ids=["overflow", "nan-step", "inf-step", "str-step", "list-step", "int-tag", "bytes-tag"],
)
def test_bad_value_step_or_tag_is_a_metric_error(metric_env, tag, value, step, names):
    path = metric_env("bad")
    with pytest.raises(MetricError, match=names):
        hypertune.report(tag, value, step=step)
    assert not path.exists()


def _unwritable(tmp_path: Path) -> list[str]:
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    directory = tmp_path / "a_dir"
    directory.mkdir()
    return [str(blocker / "output.metrics"), str(directory)]


@pytest.mark.parametrize("case", [0, 1])
def test_unwritable_metric_file_is_a_config_error_and_leaves_nothing(metric_env, monkeypatch, tmp_path, case):
    metric_env("x")
    target = _unwritable(tmp_path)[case]
    monkeypatch.setenv("CLOUD_ML_HP_METRIC_FILE", target)
    before = sorted(p.name for p in tmp_path.rglob("*"))
    with pytest.raises(ConfigError, match="CLOUD_ML_HP_METRIC_FILE") as info:
        hypertune.report("accuracy", 0.5)
    assert target in str(info.value)
    assert sorted(p.name for p in tmp_path.rglob("*")) == before  # no .tmp file left behind
    monkeypatch.setenv("CLOUD_ML_HP_METRIC_FILE", str(tmp_path / "ok" / "output.metrics"))
    assert hypertune.report("accuracy", 0.6) is True  # the failed report was not queued
    assert len((tmp_path / "ok" / "output.metrics").read_text().splitlines()) == 1


@pytest.mark.parametrize(
    "stray",
    [{"WORLD_SIZE": "1"}, {"LOCAL_RANK": "0"}, {"TORCHELASTIC_RUN_ID": "none"}, {"RANK": "zero"}],
)
def test_stray_cluster_variables_never_stop_a_report(metric_env, clean_env, monkeypatch, caplog, stray):
    path = metric_env("stray")
    monkeypatch.setattr(hypertune, "_warned_world", False, raising=False)
    for name, value in stray.items():
        monkeypatch.setenv(name, value)
    with caplog.at_level(logging.WARNING, logger="vertexrt.hypertune"):
        assert hypertune.report("accuracy", 0.5) is True
        assert hypertune.report("accuracy", 0.6) is True
    assert len(path.read_text().splitlines()) == 2  # written, as cloudml-hypertune would
    (warning,) = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert "cannot tell this process's rank" in warning and "writing the metric anyway" in warning


def test_warns_when_tag_differs_from_study_metric(metric_env, monkeypatch, caplog):
    metric_env("tag")
    monkeypatch.setenv("CLOUD_ML_HP_METRIC_TAG", "val_accuracy")
    with caplog.at_level(logging.WARNING, logger="vertexrt.hypertune"):
        hypertune.report("accuracy", 0.5)
        hypertune.report("accuracy", 0.6)
        hypertune.report("val_accuracy", 0.6)
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1  # loud once, not on every step
    assert "val_accuracy" in warnings[0].getMessage() and "'accuracy'" in warnings[0].getMessage()


def test_non_chief_does_not_write(metric_env, monkeypatch):
    path = metric_env("worker")
    monkeypatch.setattr(hypertune, "is_chief", lambda: False)
    assert hypertune.report("accuracy", 0.5) is False
    assert not path.exists()


def test_worker_replica_does_not_write(metric_env, vertex_env):
    path = metric_env("replicas")
    vertex_env(trial="2", workers=1, task=("workerpool1", 0))
    assert hypertune.is_chief() is False
    assert hypertune.report("accuracy", 0.5) is False
    assert not path.exists()
    vertex_env(trial="2", workers=1, task=("workerpool0", 0))
    assert hypertune.report("accuracy", 0.5) is True
    assert json.loads(path.read_text())["trial"] == "2"


@pytest.mark.slow
def test_only_torch_rank0_reports(tmp_path):
    pytest.importorskip("torch")
    env = {k: v for k, v in os.environ.items() if k not in ("CLUSTER_SPEC", "TF_CONFIG", "RANK")}
    script = str(Path(__file__).resolve().parent / "scripts" / "hypertune_rank.py")
    argv = lambda rank, port: [str(rank), str(port), str(tmp_path)]  # noqa: E731
    results = run_ranks(script, 2, argv, timeout=60, env=env)
    assert [code for code, _, _ in results] == [0, 0], [err[-3000:] for _, _, err in results]
    assert [out.strip() for _, out, _ in results] == ["True", "False"]
    assert (tmp_path / "rank0" / "output.metrics").exists()
    assert not (tmp_path / "rank1").exists()


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="trainer")
    parser.add_argument("--learning-rate", type=float, default=0.1)
    parser.add_argument("--batch_size", type=int, default=32)
    parser.add_argument("--layers", type=int, nargs="+", default=[1])
    parser.add_argument("--augment", type=bool, default=False)
    parser.add_argument("--optimizer", default="sgd")
    return parser


def test_parse_both_flag_forms_and_float_ints():
    args = hypertune.parse_args(
        _parser(),
        [
            "--learning_rate=0.02",
            "--batch_size",
            "256.0",
            "--layers",
            "64.0",
            "32",
            "--augment=False",
            "--optimizer",
            "adam",
            "--job-dir=gs://b/out",
        ],
    )
    assert args.learning_rate == 0.02
    assert args.batch_size == 256 and isinstance(args.batch_size, int)
    assert args.layers == [64, 32]
    assert args.augment is False
    assert args.optimizer == "adam"
    assert args.job_dir == "gs://b/out"


def test_parser_is_left_as_it_was():
    parser = _parser()
    hypertune.parse_args(parser, ["--batch_size=8"])
    with pytest.raises(SystemExit):
        parser.parse_args(["--batch_size=8.0"])  # plain argparse still strict
    assert parser.parse_args(["--job_dir", "x"]).job_dir == "x"  # --job-dir was added once


def test_non_integral_float_for_int_is_an_error(capsys):
    with pytest.raises(SystemExit):
        hypertune.parse_args(_parser(), ["--batch_size=1.5"])
    assert "invalid int value: '1.5'" in capsys.readouterr().err


def test_unknown_flags_fail_unless_asked(capsys, caplog):
    with pytest.raises(SystemExit):
        hypertune.parse_args(_parser(), ["--momentum=0.9"])
    assert "--momentum=0.9" in capsys.readouterr().err
    with caplog.at_level(logging.WARNING, logger="vertexrt.hypertune"):
        args = hypertune.parse_args(_parser(), ["--momentum=0.9", "--batch_size=4"], ignore_unknown=True)
    assert args.batch_size == 4
    assert "--momentum=0.9" in caplog.text


def test_reads_sys_argv_by_default(monkeypatch):
    monkeypatch.setattr(sys, "argv", ["trainer", "--batch_size=64.0"])
    assert hypertune.parse_args(_parser()).batch_size == 64


def test_add_job_dir_is_idempotent():
    parser = hypertune.add_job_dir(hypertune.add_job_dir(argparse.ArgumentParser()))
    assert parser.parse_args(["--job_dir", "/tmp/x"]).job_dir == "/tmp/x"
    assert parser.parse_args([]).job_dir is None


def test_a_restarted_trial_keeps_its_earlier_reports_beside_the_metric_file(metric_env, monkeypatch) -> None:
    path = metric_env("restarted")
    earlier = Path(f"{path}.earlier")
    assert hypertune.report("accuracy", 0.5, step=1)
    first = path.read_text()
    monkeypatch.setattr(hypertune, "_queues", {})  # the restarted process starts with nothing in memory
    assert hypertune.report("accuracy", 0.7, step=2)
    lines = path.read_text().splitlines()
    assert len(lines) == 1 and '"accuracy": "0.7"' in lines[0]  # what cloudml-hypertune would write
    assert hypertune.earlier_file() == str(earlier) and earlier.read_text() == first
    assert hypertune.report("accuracy", 0.8, step=3)  # same process: nothing more is moved aside
    assert earlier.read_text() == first

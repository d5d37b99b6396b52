"""Profiling: a real torch profile of a few CPU steps lands where TensorBoard's profile plugin reads it
(local and gs://); a profiler that cannot write logs once and training goes on; TensorFlow's profiler server
listens on AIP_TF_PROFILER_PORT."""

from __future__ import annotations

import json
import logging
import os
import socket
import sys

import pytest
from jobs import run_job

from vertexrt import paths
from vertexrt.runtime.profiling import StepProfiler, profile, start_tf_profiler_server

torch = pytest.importorskip("torch")


def _train(prof: StepProfiler, steps: int) -> int:
    done = 0
    for i in range(steps):
        with torch.profiler.record_function(f"user_step_{i}"):
            torch.randn(64, 64) @ torch.randn(64, 64)
        prof.step()
        done += 1
    return done


def _trace_names(root: str) -> tuple[list[str], set[str]]:
    directory = paths.join(root, "plugins", "profile", "steps_2_4")
    fs, path = paths.filesystem(directory)
    files = sorted(name.rsplit("/", 1)[-1] for name in fs.ls(path, detail=False))
    assert len(files) == 1, files
    with paths.open(paths.join(directory, files[0]), "rb") as f:
        events = json.load(f)["traceEvents"]
    return files, {e.get("name", "") for e in events}


def test_a_window_of_cpu_steps_is_traced_under_plugins_profile(storage_root: str) -> None:
    with profile(steps=range(2, 4), log_dir=storage_root) as prof:
        assert _train(prof, 6) == 6
    files, names = _trace_names(storage_root)
    assert files[0].startswith("rank0.") and files[0].endswith(".pt.trace.json")
    assert {"user_step_2", "user_step_3"} <= names
    assert not {"user_step_0", "user_step_1", "user_step_4", "user_step_5"} & names


def test_the_log_dir_defaults_to_aip_tensorboard_log_dir(clean_env, monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("AIP_TENSORBOARD_LOG_DIR", str(tmp_path / "logs"))
    with profile(steps=range(2, 4)) as prof:
        _train(prof, 3)  # training ends inside the window: the trace is still written
    found = list((tmp_path / "logs" / "plugins" / "profile" / "steps_2_4").glob("rank0.*.pt.trace.json"))
    assert len(found) == 1


def test_a_resumed_run_counts_global_steps(tmp_path) -> None:
    with profile(steps=range(2, 4), log_dir=str(tmp_path), start_step=10) as prof:
        for step in range(11, 14):
            prof.step(step)  # the window is behind this run: nothing is recorded
    assert not (tmp_path / "plugins").exists()


def test_only_the_chief_records_unless_all_ranks(tmp_path) -> None:
    with StepProfiler(range(0, 2), log_dir=str(tmp_path / "a"), rank=1) as prof:
        _train(prof, 3)
    assert not (tmp_path / "a").exists()
    with StepProfiler(range(0, 2), log_dir=str(tmp_path / "b"), rank=1, all_ranks=True) as prof:
        _train(prof, 3)
    assert len(list((tmp_path / "b").rglob("rank1.*.pt.trace.json"))) == 1


def test_a_profiler_that_cannot_write_logs_once_and_training_goes_on(tmp_path, caplog) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    caplog.set_level(logging.WARNING, logger="vertexrt.runtime.profiling")
    with profile(steps=range(1, 3), log_dir=str(blocker / "logs")) as prof:
        assert _train(prof, 5) == 5
    failures = [r for r in caplog.records if "profiling steps 1-2 failed" in r.getMessage()]
    assert len(failures) == 1, caplog.text
    assert "training goes on" in failures[0].getMessage()


def test_a_bad_tf_profiler_port_is_logged_not_raised(monkeypatch, caplog) -> None:
    monkeypatch.delenv("AIP_TF_PROFILER_PORT", raising=False)
    assert start_tf_profiler_server() is None
    monkeypatch.setenv("AIP_TF_PROFILER_PORT", "99999")
    caplog.set_level(logging.WARNING, logger="vertexrt.runtime.profiling")
    assert start_tf_profiler_server() is None
    assert "AIP_TF_PROFILER_PORT='99999' is not a port number" in caplog.text


def test_the_tf_profiler_server_listens_on_aip_tf_profiler_port(tmp_path) -> None:
    pytest.importorskip("tensorflow")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    code = (
        "import socket, sys\n"
        "from vertexrt.runtime.profiling import start_tf_profiler_server\n"
        f"assert start_tf_profiler_server() == {port}\n"
        f"assert start_tf_profiler_server() == {port}  # once per process\n"
        f"socket.create_connection(('127.0.0.1', {port}), timeout=10).close()\n"
        "print('CONNECTED')\n"
    )
    env = {**os.environ, "AIP_TF_PROFILER_PORT": str(port), "TF_CPP_MIN_LOG_LEVEL": "2"}
    done = run_job([sys.executable, "-c", code], tmp_path, 120, env, merge_stderr=False)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "CONNECTED" in done.stdout

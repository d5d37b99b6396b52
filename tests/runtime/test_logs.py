"""Replica-aware logging: plain text locally, Cloud Logging JSON lines on Vertex, quiet third parties."""

from __future__ import annotations

import io
import json
import logging
import os
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path
from typing import Any

import pytest
from jobs import run_job

from vertexrt.errors import ConfigError
from vertexrt.runtime.logs import MAX_ENTRY_BYTES, JsonLineFormatter, setup_logging

LABELS = "logging.googleapis.com/labels"
SOURCE = "logging.googleapis.com/sourceLocation"


def _emit(name: str = "vertexrt.test") -> None:
    log = logging.getLogger(name)
    log.info("hello %s", "world")
    log.warning("careful")


def test_plain_lines_carry_the_replica_and_rank(capsys: pytest.CaptureFixture[str]) -> None:
    undo = setup_logging(rank=0, replica="workerpool0-0", is_chief=True, json_lines=False)
    try:
        _emit()
    finally:
        undo()
    err = capsys.readouterr().err.splitlines()
    assert err[0].endswith("[workerpool0-0 r0] INFO vertexrt.test: hello world")
    assert err[1].endswith("[workerpool0-0 r0] WARNING vertexrt.test: careful")


def test_under_local_run_the_launchers_label_is_the_only_replica_label(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("VERTEXRT_LOCAL_RUN", "1")
    undo = setup_logging(rank=2, replica="workerpool1-0", is_chief=True, json_lines=False)
    try:
        _emit()
    finally:
        undo()
    line = capsys.readouterr().err.splitlines()[0]
    assert line.endswith("[r2] INFO vertexrt.test: hello world") and "workerpool1-0" not in line


def test_non_chief_logs_warnings_only_unless_all_ranks(capsys: pytest.CaptureFixture[str]) -> None:
    undo = setup_logging(rank=1, replica="workerpool1-0", is_chief=False, json_lines=False)
    try:
        _emit()
    finally:
        undo()
    err = capsys.readouterr().err
    assert "hello" not in err and "careful" in err
    undo = setup_logging(rank=1, replica="workerpool1-0", is_chief=False, json_lines=False, all_ranks=True)
    try:
        _emit()
    finally:
        undo()
    assert "hello world" in capsys.readouterr().err


def test_json_lines_on_stdout_with_severity_and_labels(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CLOUD_ML_JOB_ID", "1234567890")
    undo = setup_logging(
        rank=2, replica="workerpool1-1", is_chief=False, json_lines=True, labels={"trial": "3"}
    )
    try:
        _emit()
        try:
            raise ValueError("boom")
        except ValueError:
            logging.getLogger("vertexrt.test").exception("failed")
    finally:
        undo()
    out = capsys.readouterr()
    assert out.err == ""
    entries = [json.loads(line) for line in out.out.splitlines()]
    assert [e["severity"] for e in entries] == ["WARNING", "ERROR"]
    labels = {
        "rank": "2",
        "replica": "workerpool1-1",
        "trial": "3",
        "job": "1234567890",
        "python_logger": "vertexrt.test",
    }
    assert entries[0][LABELS] == labels
    assert entries[1]["message"].startswith("failed\nTraceback")
    assert "ValueError: boom" in entries[1]["message"]
    assert entries[1][SOURCE]["function"] == "test_json_lines_on_stdout_with_severity_and_labels"


def _record(level: int, msg: str, exc: bool = False) -> logging.LogRecord:
    exc_info = None
    if exc:
        try:
            raise RuntimeError("kaput")
        except RuntimeError:
            exc_info = sys.exc_info()
    return logging.getLogger("some.library").makeRecord(
        "some.library", level, "/srv/train.py", 42, "step %d of %s", (7, "x"), exc_info, func="train_step"
    )


@pytest.mark.parametrize(
    ("level", "exc"),
    [(logging.DEBUG, False), (logging.INFO, False), (logging.WARNING, False), (logging.ERROR, True),
     (logging.CRITICAL, False)],
)  # fmt: skip
def test_entries_match_google_cloud_loggings_structured_handler(level: int, exc: bool) -> None:
    """The same LogRecord through google-cloud-logging's StructuredLogHandler and through ours."""
    from google.cloud.logging_v2.handlers import StructuredLogHandler

    labels = {"rank": "0", "replica": "workerpool0-0", "trial": "3", "job": "42"}
    stream = io.StringIO()
    google = StructuredLogHandler(stream=stream, labels=labels, project_id="p")
    google.handle(_record(level, "", exc))
    theirs: dict[str, Any] = json.loads(stream.getvalue().splitlines()[-1])
    ours: dict[str, Any] = json.loads(JsonLineFormatter(labels).format(_record(level, "", exc)))

    assert ours["severity"] == theirs["severity"]
    assert ours["message"].split("\n")[0] == theirs["message"].split("\n")[0] == "step 7 of x"
    assert ours["message"].count("\n") == theirs["message"].count("\n")  # the traceback, in the same entry
    assert ours[LABELS] == theirs[LABELS]
    assert ours[SOURCE] == theirs[SOURCE] == {"file": "/srv/train.py", "line": 42, "function": "train_step"}
    google_fields = {k for k in theirs if k.startswith("logging.googleapis.com/") and theirs[k]}
    assert {"severity", "message"} | google_fields <= set(ours)


def test_custom_levels_get_a_cloud_logging_severity() -> None:
    entry = json.loads(JsonLineFormatter({}).format(_record(25, "")))
    assert entry["severity"] == "INFO"  # not "Level 25", which Cloud Logging does not know
    assert json.loads(JsonLineFormatter({}).format(_record(5, "")))["severity"] == "DEFAULT"


def test_third_party_loggers_stay_at_warning_unless_asked(capsys: pytest.CaptureFixture[str]) -> None:
    undo = setup_logging(rank=0, replica="workerpool0-0", is_chief=True, json_lines=False)
    try:
        logging.getLogger("fsspec.caching").info("cache hit")
        logging.getLogger("tensorflow").info("tf chatter")
        logging.getLogger("fsspec.caching").warning("cache trouble")
        logging.getLogger("__main__").info("user info")
        logging.getLogger("vertexrt.checkpoint").info("saved")
    finally:
        undo()
    err = capsys.readouterr().err
    assert "cache hit" not in err and "tf chatter" not in err
    assert "cache trouble" in err and "user info" in err and "saved" in err
    undo = setup_logging(
        rank=0, replica="workerpool0-0", is_chief=True, json_lines=False, third_party_level="INFO",
        app_loggers=["mytrainer"], level="DEBUG",
    )  # fmt: skip
    try:
        logging.getLogger("fsspec.caching").info("cache hit")
        logging.getLogger("mytrainer.model").debug("model debug")
        logging.getLogger("fsspec.caching").debug("cache debug")
    finally:
        undo()
    err = capsys.readouterr().err
    assert "cache hit" in err and "model debug" in err and "cache debug" not in err


def test_console_handlers_of_other_libraries_are_routed_through_ours(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """tensorflow adds its own stderr handler when imported first: its lines must not land on stderr."""
    tf_logger = logging.getLogger("tensorflow")
    own = logging.StreamHandler(sys.stderr)
    tf_logger.addHandler(own)
    try:
        undo = setup_logging(rank=0, replica="workerpool0-0", is_chief=True, json_lines=True)
        try:
            tf_logger.warning("tf warning")
            warnings.warn("a python warning", UserWarning, stacklevel=1)
        finally:
            undo()
        assert own in tf_logger.handlers  # restored
    finally:
        tf_logger.removeHandler(own)
    out = capsys.readouterr()
    assert out.err == ""
    entries = [json.loads(line) for line in out.out.splitlines()]
    assert [e["message"] for e in entries][0] == "tf warning"
    assert (
        entries[1][LABELS]["python_logger"] == "py.warnings" and "a python warning" in entries[1]["message"]
    )


def test_undo_restores_the_root_logger() -> None:
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    own = logging.getLogger("vertexrt").level
    excepthook = sys.excepthook
    setup_logging(rank=0, replica="chief-0", is_chief=True, json_lines=True, level="DEBUG")()
    assert root.handlers == handlers and root.level == level
    assert logging.getLogger("vertexrt").level == own and sys.excepthook is excepthook


def test_logging_off_leaves_everything_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VERTEXRT_LOGGING", "off")
    root = logging.getLogger()
    before = (list(root.handlers), root.level, logging.getLogger("vertexrt").level, sys.excepthook)
    undo = setup_logging(rank=0, replica="chief-0", is_chief=True, json_lines=True, level="DEBUG")
    assert (list(root.handlers), root.level, logging.getLogger("vertexrt").level, sys.excepthook) == before
    undo()
    monkeypatch.setenv("VERTEXRT_LOGGING", "quiet")
    with pytest.raises(ConfigError, match="VERTEXRT_LOGGING"):
        setup_logging(rank=0, replica="chief-0", is_chief=True, json_lines=True)


SCRIPT = textwrap.dedent(
    """
    import logging, threading, warnings
    import vertexrt

    log = logging.getLogger(__name__)

    @vertexrt.main
    def train(ctx):
        log.info("user info")
        logging.getLogger("fsspec.caching").info("fsspec chatter")
        logging.getLogger("tensorflow").info("tf chatter")
        logging.getLogger("urllib3").warning("retrying")
        warnings.warn("deprecated thing", FutureWarning)
        t = threading.Thread(target=lambda: 1 / 0, name="loader")
        t.start(); t.join()
        raise RuntimeError("training diverged")

    train()
    """
)


def _run_script(tmp_path: Path, script: str, **env: str) -> subprocess.CompletedProcess[str]:
    path = tmp_path / "train.py"
    path.write_text(script)
    return run_job([sys.executable, str(path)], tmp_path, 120, {**os.environ, **env}, merge_stderr=False)


def test_a_failing_job_on_vertex_writes_only_json_lines_to_stdout(vertex_env: Any, tmp_path: Path) -> None:
    vertex_env(trial="3", base_output_dir=str(tmp_path / "out"))
    done = _run_script(tmp_path, SCRIPT, VERTEXRT_LOG_FORMAT="json")
    assert done.returncode == 1
    assert done.stderr == ""  # Cloud Logging files every stderr line as its own ERROR entry
    entries = [json.loads(line) for line in done.stdout.splitlines()]  # every line is one JSON object
    messages = [e["message"] for e in entries]
    assert "user info" in messages and "retrying" in messages
    assert not any("chatter" in m for m in messages)
    for e in entries:
        assert e[LABELS]["job"] == "1234567890" and e[LABELS]["trial"] == "3"
        assert e[LABELS]["replica"] == "workerpool0-0" and e[LABELS]["rank"] == "0"
        assert e["severity"] in {"DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"}
    user = next(e for e in entries if e["message"] == "user info")
    assert user[SOURCE] == {"file": str(tmp_path / "train.py"), "line": 9, "function": "train"}
    warning = next(e for e in entries if "deprecated thing" in e["message"])
    assert warning["severity"] == "WARNING"
    thread = [e for e in entries if "ZeroDivisionError" in e["message"]]
    assert len(thread) == 1 and "Traceback" in thread[0]["message"] and "loader" in thread[0]["message"]
    crash = [e for e in entries if "Traceback" in e["message"] and "training diverged" in e["message"]]
    assert len(crash) == 1 and crash[0]["severity"] in {"ERROR", "CRITICAL"}
    assert crash[0][SOURCE]["function"] == "train"


def test_a_local_run_logs_text_and_keeps_third_parties_quiet(clean_env: None, tmp_path: Path) -> None:
    """The user's own basicConfig handler is replaced by ours (not doubled), and third parties stay quiet."""
    script = "import logging\nlogging.basicConfig(level=logging.INFO, format='MINE %(message)s')\n" + SCRIPT
    done = _run_script(
        tmp_path, script.replace('raise RuntimeError("training diverged")', ""), VERTEXRT_LOG_FORMAT="text"
    )
    assert done.returncode == 0, done.stderr
    assert "MINE" not in done.stderr
    assert "INFO __main__: user info" in done.stderr
    assert "chatter" not in done.stderr and "WARNING urllib3: retrying" in done.stderr
    assert "INFO vertexrt.runtime.entry: done" in done.stderr


def test_logging_off_keeps_the_users_own_configuration(clean_env: None, tmp_path: Path) -> None:
    script = "import logging\nlogging.basicConfig(level=logging.INFO, format='MINE %(message)s')\n" + SCRIPT
    script = script.replace('raise RuntimeError("training diverged")', "")
    done = _run_script(tmp_path, script, VERTEXRT_LOGGING="off")
    assert done.returncode == 0, done.stderr
    assert "MINE user info" in done.stderr and "MINE fsspec chatter" in done.stderr
    assert "[chief-0 r0]" not in done.stderr  # no second handler of ours next to the user's


def test_the_users_package_logs_at_info_when_run_with_dash_m(clean_env: None, tmp_path: Path) -> None:
    package = tmp_path / "mytrainer"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "model.py").write_text(
        "import logging\n\ndef build():\n    logging.getLogger(__name__).info('built')\n"
    )
    (package / "task.py").write_text(
        "import logging, vertexrt\nfrom mytrainer import model\n\n"
        "@vertexrt.main\ndef train(ctx):\n    model.build()\n"
        "    logging.getLogger('fsspec').info('chatter')\n\ntrain()\n"
    )
    env = {**os.environ, "VERTEXRT_LOG_FORMAT": "text"}
    done = run_job([sys.executable, "-m", "mytrainer.task"], tmp_path, 120, env, merge_stderr=False)
    assert done.returncode == 0, done.stderr
    assert "INFO mytrainer.model: built" in done.stderr and "chatter" not in done.stderr


@pytest.mark.parametrize("filler", ["x", "\x01", "é"])  # 1, 6 (JSON escape) and 2 bytes per character
def test_an_entry_over_cloud_loggings_limit_is_cut_in_the_middle_with_a_marker(filler: str) -> None:
    message = "HEAD " + filler * 600_000 + " Traceback ... ValueError: the tail"
    record = logging.getLogger("vertexrt.test").makeRecord(
        "vertexrt.test", logging.ERROR, "/srv/train.py", 1, message, (), None
    )
    line = JsonLineFormatter({"rank": "0"}).format(record)
    assert len(line.encode()) <= MAX_ENTRY_BYTES < 256 * 1024
    kept = json.loads(line)["message"]
    assert kept.startswith("HEAD ") and kept.endswith("ValueError: the tail")
    assert "vertexrt cut " in kept and f"of {len(message.encode())} bytes" in kept


def test_a_short_entry_is_left_whole() -> None:
    message = "y" * (MAX_ENTRY_BYTES // 2)
    record = logging.getLogger("t").makeRecord("t", logging.INFO, "/srv/train.py", 1, message, (), None)
    assert json.loads(JsonLineFormatter({}).format(record))["message"] == message


def test_bytes_that_are_not_utf8_are_escaped_and_every_line_is_utf8(tmp_path: Path) -> None:
    """A file name with a Latin-1 byte (kept by surrogateescape) and half a UTF-16 pair, logged on Vertex
    by a process whose stdout passes surrogates through as raw bytes (as in a C-locale container)."""
    script = textwrap.dedent(
        """
        import logging, os
        from vertexrt.runtime.logs import setup_logging

        undo = setup_logging(rank=0, replica="workerpool0-0", is_chief=True, json_lines=True)
        name = os.fsdecode(b"/data/caf\\xe9.jsonl")
        logging.getLogger("vertexrt.test").warning("cannot read %s: %s", name, "half \\ud83d pair")
        undo()
        """
    )
    path = tmp_path / "log_bytes.py"
    path.write_text(script)
    # subprocess, not jobs.run_job: the assertion is a strict UTF-8 decode of the raw stdout bytes
    done = subprocess.run(
        [sys.executable, str(path)], capture_output=True, timeout=120,
        env={**os.environ, "PYTHONIOENCODING": "utf-8:surrogateescape"},
    )  # fmt: skip
    assert done.returncode == 0 and done.stderr == b"", done.stderr
    (line,) = done.stdout.decode("utf-8").splitlines()  # strict: every byte is UTF-8
    assert json.loads(line)["message"] == "cannot read /data/caf\\xe9.jsonl: half \\ud83d pair"

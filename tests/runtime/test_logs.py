"""Replica-prefixed logging: plain text locally, JSON lines on Vertex, INFO from the chief only."""

from __future__ import annotations

import json
import logging

import pytest

from vertexrt.runtime.logs import setup_logging


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


def test_json_lines_on_stdout_with_severity_and_labels(capsys: pytest.CaptureFixture[str]) -> None:
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
    labels = {"rank": "2", "replica": "workerpool1-1", "trial": "3"}
    assert entries[0]["logging.googleapis.com/labels"] == labels
    assert entries[1]["message"].startswith("failed\nTraceback")
    assert "ValueError: boom" in entries[1]["message"]


def test_undo_restores_the_root_logger() -> None:
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    setup_logging(rank=0, replica="chief-0", is_chief=True, json_lines=False, level="DEBUG")()
    assert root.handlers == handlers and root.level == level

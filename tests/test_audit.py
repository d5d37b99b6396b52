"""vertexrt.audit: off by default; on, one JSON line per event, and a fault plan lands where it says."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest

from vertexrt import audit


@pytest.fixture
def audited(tmp_path: Path, monkeypatch):
    def start(plan: dict | None = None) -> Path:
        monkeypatch.setenv(audit.DIRECTORY_VARIABLE, str(tmp_path))
        monkeypatch.setenv(audit.REPLICA_VARIABLE, "workerpool0-0")
        monkeypatch.setenv(audit.PLAN_VARIABLE, json.dumps(plan or {}))
        audit.reset()
        return tmp_path / "workerpool0-0.jsonl"

    yield start
    audit.reset()


def _events(path: Path) -> list[tuple[str, int | None]]:
    return [(e["event"], e.get("step")) for e in map(json.loads, path.read_text().splitlines())]


def test_off_without_the_variable_writes_nothing(tmp_path, monkeypatch) -> None:
    monkeypatch.delenv(audit.DIRECTORY_VARIABLE, raising=False)
    monkeypatch.chdir(tmp_path)
    audit.reset()
    audit.step(1)
    audit.event("commit", step=1)
    assert list(tmp_path.iterdir()) == []


def test_steps_are_counted_once_and_a_position_report_is_not_a_step(audited) -> None:
    path = audited()
    audit.step(0)  # the watchdog's first beat reports the position, nothing done yet
    audit.event("resume", step=4)
    audit.step(4)  # the restored step again
    audit.step(5)
    audit.step(5)
    audit.event("commit", step=5)
    assert _events(path) == [("resume", 4), ("step", 5), ("commit", 5)]


@pytest.mark.parametrize(
    ("fault", "landed"),
    [
        ({"on": "step", "at": 3}, ("fault", 3)),
        ({"on": "first_step"}, ("fault", 1)),
        ({"on": "save", "at": 2, "asynchronous": True}, ("fault", 2)),
    ],
)
def test_a_fault_lands_inside_its_event(audited, fault, landed) -> None:
    received = []
    previous = signal.signal(signal.SIGUSR1, lambda *_: received.append(True))
    try:
        path = audited({"fault": {**fault, "signal": "SIGUSR1"}})
        for step in (1, 2, 3, 4):
            audit.step(step)
            audit.event("save", step=step, asynchronous=step % 2 == 0)
    finally:
        signal.signal(signal.SIGUSR1, previous)
    assert received == [True]  # once
    events = _events(path)
    faults = [i for i, e in enumerate(events) if e[0] == "fault"]
    assert [events[i] for i in faults] == [landed]

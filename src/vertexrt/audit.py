"""The resume audit: what a training process did, for ``vertexrt local-run --chaos``; off unless asked.

vertexrt's hooks call it with one line each: steps (``HangWatchdog.beat``, which the Trainer, ``ctx.step()``
and the Keras callback feed), epoch ends and evaluations (Trainer), checkpoint saves, commits and restores
(``CheckpointManager``). Off (no ``VERTEXRT_AUDIT_DIR``), every call is one check of a cached flag (and
``step`` keeps the number for :func:`last_step`, which the crash-loop guard records). On, each
event is one JSON line appended to ``$VERTEXRT_AUDIT_DIR/<replica>.jsonl`` with a single ``write`` on an
``O_APPEND`` file (no buffer a SIGKILL could lose; forked processes never interleave half lines).

``VERTEXRT_AUDIT_PLAN`` (JSON, set by the chaos driver per replica and attempt) places a fault exactly
where it must land: ``{"fault": {"on": "step"|"first_step"|"eval"|"save", "at": N, "asynchronous": bool,
"signal": "SIGTERM"|"SIGKILL"}, "slow": {"from": STEP, "by": SECONDS, "max": SECONDS}}``. The fault fires at
the first matching event (a step ``>= at``, the ``at``-th evaluation, a save of a step ``>= at``): a
``fault`` event is written, then the process signals itself, so the notice arrives inside that step,
evaluation or save. ``slow`` makes each step from ``from`` on ``by`` seconds slower than the last, up to
``max`` (a step time that grows during the run).

This module imports nothing from vertexrt: every layer may call it.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from typing import Any

DIRECTORY_VARIABLE = "VERTEXRT_AUDIT_DIR"
REPLICA_VARIABLE = "VERTEXRT_AUDIT_REPLICA"
PLAN_VARIABLE = "VERTEXRT_AUDIT_PLAN"


class _Audit:
    def __init__(self, directory: str, replica: str, plan: dict[str, Any]) -> None:
        os.makedirs(directory, exist_ok=True)
        path = os.path.join(directory, replica.replace("/", "_") + ".jsonl")
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        self.fault: dict[str, Any] | None = plan.get("fault")
        self.slow: dict[str, Any] | None = plan.get("slow")
        self.last_step = 0
        self.evals = 0
        self.in_eval = False
        self.lock = threading.RLock()

    def emit(self, event: str, fields: dict[str, Any]) -> None:
        record = {"event": event, "time": time.time(), "pid": os.getpid(), **fields}
        os.write(self.fd, (json.dumps(record) + "\n").encode())

    def on(self, event: str, fields: dict[str, Any]) -> None:
        with self.lock:
            if event == "step":
                step = int(fields["step"])
                if step <= self.last_step:  # a position report (e.g. the restored step), not a new step
                    return
                self.last_step = step
                self._slow_down(step)
            elif event == "resume":
                self.last_step = int(fields["step"])
            elif event == "eval":
                self.evals += 1
                self.in_eval = True
            elif event == "eval_end":
                self.in_eval = False
            self.emit(event, fields)
            fault = self.fault
            if fault is None or not self._lands(fault, event, fields):
                return
            self.fault = None
            where = {k: v for k, v in fields.items() if k != "step"}
            self.emit(
                "fault",
                {"signal": fault["signal"], "on": event, "step": self.last_step, "in_eval": self.in_eval}
                | where,
            )
        os.kill(os.getpid(), getattr(signal, fault["signal"]))  # the notice lands inside this event

    def _lands(self, fault: dict[str, Any], event: str, fields: dict[str, Any]) -> bool:
        on, at = fault["on"], int(fault.get("at", 0))
        if on == "first_step":
            return event == "step"
        if on == "step":
            return event == "step" and int(fields["step"]) >= at
        if on == "eval":
            return event == "eval" and self.evals >= at
        if on == "save":
            wanted = fault.get("asynchronous")
            return (
                event == "save"
                and int(fields["step"]) >= at
                and (wanted is None or bool(fields.get("asynchronous")) == wanted)
            )
        return False

    def _slow_down(self, step: int) -> None:
        slow = self.slow
        if slow is not None and step >= int(slow["from"]):
            time.sleep(min(float(slow["max"]), (step - int(slow["from"]) + 1) * float(slow["by"])))


_UNSET: Any = object()
_audit: _Audit | None = _UNSET
_last_step: int | None = None


def _load() -> _Audit | None:
    global _audit
    directory = os.environ.get(DIRECTORY_VARIABLE)
    if not directory:
        _audit = None
        return None
    replica = os.environ.get(REPLICA_VARIABLE) or f"pid{os.getpid()}"
    plan = json.loads(os.environ.get(PLAN_VARIABLE) or "{}")
    _audit = _Audit(directory, replica, plan)
    return _audit


def active() -> bool:
    """True when auditing is on (``VERTEXRT_AUDIT_DIR`` set): one check of a cached flag."""
    audit = _audit
    if audit is _UNSET:
        audit = _load()
    return audit is not None


def step(number: int) -> None:
    """Step ``number`` completed (a number not above the last one is a position report, not a step)."""
    global _last_step
    _last_step = number
    audit = _audit
    if audit is None:
        return
    if audit is _UNSET and (audit := _load()) is None:
        return
    audit.on("step", {"step": number})


def last_step() -> int | None:
    """The last step any hook reported in this process, audited or not (``None`` before the first): what
    the crash-loop guard records (:mod:`vertexrt.runtime.attempts`)."""
    return _last_step


def event(name: str, **fields: Any) -> None:
    """Record ``name`` (``epoch_end``, ``eval``, ``eval_end``, ``save``, ``commit``, ``resume``...) with
    JSON-serialisable ``fields``."""
    audit = _audit
    if audit is None:
        return
    if audit is _UNSET and (audit := _load()) is None:
        return
    audit.on(name, fields)


def reset() -> None:
    """Read the environment again at the next call (tests)."""
    global _audit
    if isinstance(_audit, _Audit):
        os.close(_audit.fd)
    _audit = _UNSET

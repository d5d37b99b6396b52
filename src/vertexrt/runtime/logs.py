"""Replica-prefixed logging for a training process, set up by ``@vertexrt.main`` (never at import).

Locally each line is plain text prefixed with the replica (``[workerpool0-0 r0]``) on stderr; on Vertex
it is one JSON object per line on stdout with ``severity`` (Cloud Logging files anything on stderr as
ERROR). Only the chief logs INFO by default; other ranks log WARNING and above.

Example:
    >>> undo = setup_logging(rank=0, replica="workerpool0-0", is_chief=True, json_lines=False)
    >>> undo()
"""

from __future__ import annotations

import json
import logging
import sys
import time
from collections.abc import Callable

_SEVERITY = {"WARNING": "WARNING", "CRITICAL": "CRITICAL", "ERROR": "ERROR", "INFO": "INFO", "DEBUG": "DEBUG"}


class ReplicaFormatter(logging.Formatter):
    """Plain text: ``2026-11-22 01:20:00 [workerpool0-1 r2] INFO name: message``."""

    def __init__(self, prefix: str) -> None:
        super().__init__(f"%(asctime)s [{prefix}] %(levelname)s %(name)s: %(message)s", "%Y-%m-%d %H:%M:%S")


class JsonLineFormatter(logging.Formatter):
    """One JSON object per line in the shape Cloud Logging parses (``severity``, ``message``, labels)."""

    def __init__(self, labels: dict[str, str]) -> None:
        super().__init__()
        self._labels = labels

    def format(self, record: logging.LogRecord) -> str:
        message = record.getMessage()
        if record.exc_info:
            message = f"{message}\n{self.formatException(record.exc_info)}"
        entry = {
            "severity": _SEVERITY.get(record.levelname, "DEFAULT"),
            "message": message,
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "logger": record.name,
            "logging.googleapis.com/labels": self._labels,
        }
        return json.dumps(entry, ensure_ascii=False)


def setup_logging(
    *,
    rank: int,
    replica: str,
    is_chief: bool,
    json_lines: bool,
    level: int | str = logging.INFO,
    all_ranks: bool = False,
    labels: dict[str, str] | None = None,
) -> Callable[[], None]:
    """Attach one replica-aware handler to the root logger; return a function that undoes it.

    Args:
        rank: global rank of this process (shown in every line).
        replica: the Vertex replica name, e.g. ``workerpool0-0``.
        is_chief: the chief logs at ``level``; others at WARNING unless ``all_ranks``.
        json_lines: JSON lines on stdout (Vertex) instead of plain text on stderr.
        level: the chief's level.
        all_ranks: log at ``level`` on every rank.
        labels: extra labels for JSON lines (e.g. the trial id).
    """
    root = logging.getLogger()
    level_no = logging.getLevelName(level) if isinstance(level, str) else level
    effective = level_no if (is_chief or all_ranks) else max(level_no, logging.WARNING)
    handler = logging.StreamHandler(sys.stdout if json_lines else sys.stderr)
    if json_lines:
        handler.setFormatter(JsonLineFormatter({"rank": str(rank), "replica": replica, **(labels or {})}))
    else:
        handler.setFormatter(ReplicaFormatter(f"{replica} r{rank}"))
    previous_level = root.level
    root.addHandler(handler)
    root.setLevel(effective)
    logging.captureWarnings(True)

    def undo() -> None:
        root.removeHandler(handler)
        root.setLevel(previous_level)
        logging.captureWarnings(False)

    return undo

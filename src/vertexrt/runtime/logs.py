"""Replica-aware logging for a training process, set up by ``@vertexrt.main`` (never at import).

Locally each line is plain text prefixed with the replica (``[workerpool0-0 r0]``) on stderr. On Vertex
(or with ``VERTEXRT_LOG_FORMAT=json``) it is one JSON object per line on stdout, in the shape of
google-cloud-logging's ``StructuredLogHandler``: ``severity``, ``message`` (with the traceback, one entry
per exception), ``logging.googleapis.com/labels`` (job, trial, replica, rank, python_logger) and
``logging.googleapis.com/sourceLocation``. Cloud Logging files every stderr line as a separate ERROR.
Each JSON line is valid UTF-8 (a byte that is not, kept in a ``str`` by ``surrogateescape``, is written
as ``\\xNN``) and at most ``MAX_ENTRY_BYTES``: Cloud Logging drops entries over 256 KB, so a longer
message keeps its head and its tail (where a traceback names the error) around a visible marker.

Levels: the ``vertexrt`` logger and the user's (``__main__``, the package of ``python -m pkg.task``, any
``app_loggers``) get ``level`` on the chief (WARNING on other ranks unless ``all_ranks``); the root logger,
so every third-party logger (fsspec, tensorflow, urllib3, ...), gets ``third_party_level`` (WARNING).
Python warnings are routed through logging. Console handlers already attached (the user's
``basicConfig``, tensorflow's own stderr handler, absl's) are detached while the setup is active and put
back by the undo, so nothing is printed twice or lands on stderr.

``VERTEXRT_LOGGING=off`` leaves the logging configuration completely alone (no handler, level, warning
capture or excepthook change); ``VERTEXRT_LOG_FORMAT=text|json`` picks the format (read by ``@main``).

Example:
    >>> undo = setup_logging(rank=0, replica="workerpool0-0", is_chief=True, json_lines=False)
    >>> undo()
"""

from __future__ import annotations

import json
import logging
import os
import re
import sys
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from types import TracebackType
from typing import Any

from vertexrt.errors import ConfigError

#: Loggers that get the chosen ``level``: vertexrt's own and the user's script.
OWN_LOGGERS = ("vertexrt", "__main__")

#: Seconds between refreshes of a user's tqdm bar while JSON lines are on (``TQDM_MININTERVAL``).
TQDM_MININTERVAL = "30"

_MAX_LABEL = 1024  # Cloud Logging truncates label values; a hostile env value stays bounded

#: The largest JSON line written, in bytes: below Cloud Logging's 256 KB per entry, with room for the
#: fields the logging agent adds.
MAX_ENTRY_BYTES = 240_000
_MARKER_BYTES = 200
_LONE_SURROGATE = re.compile("[\ud800-\udfff]")


def severity(levelno: int) -> str:
    """The Cloud Logging severity of a ``logging`` level.

    Example:
        >>> severity(logging.WARNING), severity(25), severity(5)
        ('WARNING', 'INFO', 'DEFAULT')
    """
    for threshold, name in (
        (logging.CRITICAL, "CRITICAL"),
        (logging.ERROR, "ERROR"),
        (logging.WARNING, "WARNING"),
        (logging.INFO, "INFO"),
        (logging.DEBUG, "DEBUG"),
    ):
        if levelno >= threshold:
            return name
    return "DEFAULT"


class ReplicaFormatter(logging.Formatter):
    """Plain text: ``2026-11-22 01:20:00 [workerpool0-1 r2] INFO name: message``."""

    def __init__(self, prefix: str) -> None:
        super().__init__(f"%(asctime)s [{prefix}] %(levelname)s %(name)s: %(message)s", "%Y-%m-%d %H:%M:%S")


class JsonLineFormatter(logging.Formatter):
    """One JSON object per line, in the shape of google-cloud-logging's ``StructuredLogHandler``."""

    def __init__(self, labels: dict[str, str]) -> None:
        super().__init__()
        self._labels = labels

    def format(self, record: logging.LogRecord) -> str:
        message = record.getMessage()
        if record.exc_info:
            message = f"{message}\n{self.formatException(record.exc_info)}"
        if record.stack_info:
            message = f"{message}\n{self.formatStack(record.stack_info)}"
        source = {"file": record.pathname, "line": record.lineno, "function": record.funcName}
        return _entry(message, record.levelno, record.created, record.name, self._labels, source)


def setup_logging(
    *,
    rank: int,
    replica: str,
    is_chief: bool,
    json_lines: bool,
    level: int | str = logging.INFO,
    all_ranks: bool = False,
    labels: dict[str, str] | None = None,
    third_party_level: int | str = logging.WARNING,
    app_loggers: Sequence[str] = (),
) -> Callable[[], None]:
    """Attach one replica-aware handler to the root logger; return a function that undoes it.

    Args:
        rank: global rank of this process (shown in every line).
        replica: the Vertex replica name, e.g. ``workerpool0-0``.
        is_chief: the chief logs at ``level``; others at WARNING unless ``all_ranks``.
        json_lines: JSON lines on stdout (Vertex) instead of plain text on stderr.
        level: the level of vertexrt's and the user's loggers (``OWN_LOGGERS`` + ``app_loggers``).
        all_ranks: log at ``level`` on every rank.
        labels: extra labels for JSON lines (e.g. the trial id); ``job`` defaults to ``$CLOUD_ML_JOB_ID``.
        third_party_level: the root logger's level, so every other library's.
        app_loggers: more logger names that get ``level`` (e.g. the user's package).

    With ``VERTEXRT_LOGGING=off`` nothing is changed and the returned function does nothing.
    """
    if not _enabled():
        return lambda: None
    own_level = _level_number("level", level)
    others = _level_number("third_party_level", third_party_level)
    if not (is_chief or all_ranks):
        own_level, others = max(own_level, logging.WARNING), max(others, logging.WARNING)
    all_labels = {**_default_labels(rank, replica), **(labels or {})}
    handler = logging.StreamHandler(sys.stdout if json_lines else sys.stderr)
    if json_lines:
        handler.setFormatter(JsonLineFormatter(all_labels))
    else:
        # under local-run the launcher already prefixes each line with the replica: one label, not two
        prefix = f"r{rank}" if os.environ.get("VERTEXRT_LOCAL_RUN") else f"{replica} r{rank}"
        handler.setFormatter(ReplicaFormatter(prefix))

    root = logging.getLogger()
    undo_steps: list[Callable[[], None]] = [_detach_console_handlers()]
    root.addHandler(handler)
    undo_steps.append(lambda: root.removeHandler(handler))
    undo_steps.append(_set_level(root, others))
    for name in dict.fromkeys((*OWN_LOGGERS, *_main_package(), *app_loggers)):
        undo_steps.append(_set_level(logging.getLogger(name), own_level))
    undo_steps.append(_capture_warnings())
    if json_lines:
        undo_steps.append(_json_excepthooks(all_labels))
        undo_steps.append(_setdefault_env("TQDM_MININTERVAL", TQDM_MININTERVAL))

    def undo() -> None:
        for step in reversed(undo_steps):
            step()

    return undo


def _enabled() -> bool:
    chosen = os.environ.get("VERTEXRT_LOGGING", "").strip().lower()
    if chosen in ("", "on"):
        return True
    if chosen == "off":
        return False
    raise ConfigError(
        f"VERTEXRT_LOGGING={chosen[:40]!r}: use 'off' (leave logging alone) or 'on' (or unset it)"
    )


def _level_number(name: str, level: int | str) -> int:
    number = logging.getLevelName(level.upper()) if isinstance(level, str) else level
    if not isinstance(number, int):
        raise ConfigError(
            f"{name}={level!r} is not a logging level: use DEBUG, INFO, WARNING, ERROR or a number"
        )
    return number


def _main_package() -> tuple[str, ...]:
    """The top-level package of a script run as ``python -m trainer.task`` (``trainer``), else nothing."""
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    name = getattr(spec, "name", None) or ""
    return (name.partition(".")[0],) if name else ()


def _default_labels(rank: int, replica: str) -> dict[str, str]:
    labels = {"rank": str(rank), "replica": replica}
    job = os.environ.get("CLOUD_ML_JOB_ID", "").strip()
    if job:
        labels["job"] = job[:_MAX_LABEL]
    return labels


def _entry(
    message: str, levelno: int, created: float, logger: str, labels: dict[str, str], source: dict[str, Any]
) -> str:
    message = _utf8(message)
    entry = {
        "severity": severity(levelno),
        "message": message,
        "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(created))
        + f".{int(created * 1000) % 1000:03d}Z",
        "logging.googleapis.com/labels": {
            _utf8(k): _utf8(v) for k, v in {**labels, "python_logger": logger}.items()
        },
        "logging.googleapis.com/sourceLocation": {
            k: _utf8(v) if isinstance(v, str) else v for k, v in source.items()
        },
    }
    line = json.dumps(entry, ensure_ascii=False)
    excess = len(line.encode()) - MAX_ENTRY_BYTES
    if excess > 0:
        size = len(message.encode())
        escaped = len(json.dumps(message, ensure_ascii=False).encode())  # control characters take 6 bytes
        keep = int((escaped - excess - _MARKER_BYTES) * size / escaped)
        while True:  # a second round at most: each byte cut is at least one byte (its escape) off the line
            entry["message"] = _shortened(message, max(0, keep))
            line = json.dumps(entry, ensure_ascii=False)
            over = len(line.encode()) - MAX_ENTRY_BYTES
            if over <= 0 or keep <= 0:
                return line
            keep -= over
    return line


def _utf8(text: str) -> str:
    """``text`` with each lone surrogate written as an escape, so that it encodes as valid UTF-8: ``\\xNN``
    for a byte that was not UTF-8 (kept by ``surrogateescape``, e.g. in a file name), ``\\uNNNN`` for half
    of a broken UTF-16 pair."""
    if not _LONE_SURROGATE.search(text):
        return text

    def escape(match: re.Match[str]) -> str:
        code = ord(match.group())
        return f"\\x{code - 0xDC00:02x}" if 0xDC80 <= code <= 0xDCFF else f"\\u{code:04x}"

    return _LONE_SURROGATE.sub(escape, text)


def _shortened(message: str, keep: int) -> str:
    """``message`` cut to its first and last ``keep`` bytes (UTF-8; two thirds of them from the head, which
    says what happened, the rest from the tail, which holds a traceback's error) around a marker."""
    data = message.encode()
    head, tail = data[: keep * 2 // 3], data[len(data) - (keep - keep * 2 // 3) :]
    marker = (
        f"\n[... vertexrt cut {len(data) - len(head) - len(tail)} of {len(data)} bytes from the middle of "
        "this log entry: Cloud Logging keeps at most 256 KB per entry ...]\n"
    )
    return head.decode(errors="ignore") + marker + tail.decode(errors="ignore")  # no character split in two


def _set_level(logger: logging.Logger, level: int) -> Callable[[], None]:
    previous = logger.level
    logger.setLevel(level)
    return lambda: logger.setLevel(previous)


def _is_console(handler: logging.Handler) -> bool:
    """A handler that prints to the terminal: a plain StreamHandler on stdout/stderr, or absl's."""
    if type(handler).__name__ == "ABSLHandler":
        return True
    consoles = (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__)
    return type(handler) is logging.StreamHandler and any(handler.stream is c for c in consoles)


def _detach_console_handlers() -> Callable[[], None]:
    """Detach console handlers (root's, tensorflow's own) so their records go through ours, once."""
    loggers: list[logging.Logger] = [logging.getLogger()]
    loggers += [
        obj for obj in list(logging.Logger.manager.loggerDict.values()) if isinstance(obj, logging.Logger)
    ]
    detached = [(lg, h) for lg in loggers for h in list(lg.handlers) if _is_console(h)]
    for lg, h in detached:
        lg.removeHandler(h)

    def restore() -> None:
        for lg, h in detached:
            lg.addHandler(h)

    return restore


def _capture_warnings() -> Callable[[], None]:
    was_captured = getattr(logging, "_warnings_showwarning", None) is not None
    logging.captureWarnings(True)
    return lambda: logging.captureWarnings(was_captured)


def _setdefault_env(name: str, value: str) -> Callable[[], None]:
    if name in os.environ:
        return lambda: None
    os.environ[name] = value

    def restore() -> None:
        os.environ.pop(name, None)

    return restore


def _exception_entry(
    kind: type[BaseException],
    value: BaseException,
    tb: TracebackType | None,
    labels: dict[str, str],
    where: str,
) -> str:
    text = "".join(traceback.format_exception(kind, value, tb)).rstrip("\n")
    frames = traceback.extract_tb(tb) if tb is not None else []
    last = frames[-1] if frames else None
    source = {"file": last.filename, "line": last.lineno, "function": last.name} if last else {}
    return _entry(f"{where}\n{text}", logging.CRITICAL, time.time(), "vertexrt.excepthook", labels, source)


def _json_excepthooks(labels: dict[str, str]) -> Callable[[], None]:
    """Print uncaught exceptions (main thread and others) as one JSON entry each, not one ERROR per line.

    The returned undo keeps the main-thread hook when it runs while an exception is on its way out (the
    ``finally`` of ``@main``), so that exception's traceback is still one entry.
    """
    previous_hook, previous_thread_hook = sys.excepthook, threading.excepthook

    def hook(kind: type[BaseException], value: BaseException, tb: TracebackType | None) -> None:
        if issubclass(kind, KeyboardInterrupt):
            previous_hook(kind, value, tb)
            return
        print(_exception_entry(kind, value, tb, labels, "uncaught exception"), file=sys.stdout, flush=True)

    def thread_hook(args: threading.ExceptHookArgs) -> None:
        if args.exc_value is None or issubclass(args.exc_type, SystemExit):
            previous_thread_hook(args)
            return
        where = f"uncaught exception in thread {args.thread.name if args.thread else '?'}"
        print(_exception_entry(args.exc_type, args.exc_value, args.exc_traceback, labels, where), flush=True)

    sys.excepthook, threading.excepthook = hook, thread_hook

    def restore() -> None:
        threading.excepthook = previous_thread_hook
        if sys.exc_info()[1] is None and sys.excepthook is hook:
            sys.excepthook = previous_hook

    return restore

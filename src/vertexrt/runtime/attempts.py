"""The crash-loop guard: a job whose attempts fail the same way at the same step is stopped, not restarted.

Vertex restarts a failed worker up to 5 times and then retries the whole job up to 3 times, and it retries
SIGABRT / SIGSEGV exits as transient, so a deterministic bug can be launched again and again before anyone
looks. ``@vertexrt.main`` keeps an attempt log beside the checkpoints, ``<checkpoint dir>/attempts/rank-R/``:
one small JSON object per attempt that ended in a failure (its fingerprint and the step reached) or in a
preemption, written through :mod:`vertexrt.paths` by the rank it describes. Each object has one writer and
is written once (``gs://`` has no locks and no appends), and each rank lists only its own prefix: O(1) in the
world size, no I/O until an attempt ends. When a rank fails with the same fingerprint at the same step as in
its previous attempt of the same job (``CLOUD_ML_JOB_ID``), it prints the traceback and one crash-loop
message, and exits :data:`vertexrt.env.CRASH_LOOP_EXIT_CODE` (93): a permanent error on Vertex, which ends
the job; ``local-run`` does not restart it either.

The fingerprint is the exception's type and where it was raised: ``file:function`` of the innermost frame
(the file as its last two path components). No message: messages carry values that change between attempts
(addresses, ports, timings, tensor values). No line number: a job whose container installs its package and
requirements at start may get another patch release on a retry, which moves lines but not functions.

A preemption is recorded and ends the chain: it never counts as a crash. A step of ``None`` (the failure came
before the first reported step) is a step like any other: a script that fails the same way while starting
up is looping too. A record that cannot be read (cut by a SIGKILL, edited) is reported with a warning and
removed, and the log starts afresh; a log that cannot be reached at all is a warning: the guard never turns
a failure into another one. Off with ``VERTEXRT_CRASH_LOOP_GUARD=0``, and off for a run without a job ID
(plain ``python train.py``: nothing restarts it).

Each record also holds when its attempt started, so the log tells the job's mean time between failures
(:func:`mean_time_between_failures`), which a ``YoungDaly`` checkpoint policy spaces durable saves by.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import TypeVar

from vertexrt.env import CRASH_LOOP_EXIT_CODE
from vertexrt.errors import ConfigError

logger = logging.getLogger(__name__)

SWITCH_VARIABLE = "VERTEXRT_CRASH_LOOP_GUARD"
#: Records kept per rank (older ones are removed after a write): a job has at most ~24 attempts on Vertex.
KEPT_RECORDS = 16
#: A record larger than this is not one of ours.
MAX_RECORD_BYTES = 16 * 1024
_OUTCOMES = ("failed", "preempted")
_MAX_TEXT = 300

T = TypeVar("T")


@dataclass(frozen=True)
class Attempt:
    """How one attempt of a rank ended: ``failed`` (with the failure's fingerprint, its message cut to a
    few hundred characters, and the last step reported) or ``preempted``; ``time`` when it ended, ``started``
    when it began (0: not recorded)."""

    outcome: str
    job: str | None
    step: int | None = None
    fingerprint: str | None = None
    error: str = ""
    replica: str = ""
    time: float = 0.0
    started: float = 0.0

    def same_failure(self, other: Attempt) -> bool:
        """Both failed with the same fingerprint at the same step."""
        return (
            self.outcome == other.outcome == "failed"
            and self.fingerprint == other.fingerprint
            and self.step == other.step
        )


def enabled() -> bool:
    """``VERTEXRT_CRASH_LOOP_GUARD``: on unless ``0``/``off``/``false``/``no``.

    Raises:
        ConfigError: another value.
    """
    value = os.environ.get(SWITCH_VARIABLE, "").strip().lower()
    if value in ("", "1", "on", "true", "yes"):
        return True
    if value in ("0", "off", "false", "no"):
        return False
    raise ConfigError(f"{SWITCH_VARIABLE}={value[:40]!r}: use 1 (the default) or 0 to turn the guard off")


def fingerprint(err: BaseException) -> str:
    """``Type@dir/file.py:function`` of the innermost frame of ``err``'s traceback (``Type`` alone without
    one)."""
    kind = type(err)
    name = kind.__qualname__ if kind.__module__ == "builtins" else f"{kind.__module__}.{kind.__qualname__}"
    frames = traceback.extract_tb(err.__traceback__)
    if not frames:
        return name
    last = frames[-1]
    where = "/".join(last.filename.replace(os.sep, "/").split("/")[-2:])
    return f"{name}@{where}:{last.name}"


class AttemptLog:
    """One rank's attempt records under ``directory`` (local, ``/gcs/`` or ``gs://``), for job ``job``."""

    def __init__(self, directory: str, *, job: str | None) -> None:
        self.directory = directory
        self.job = job

    @classmethod
    def for_rank(cls, checkpoint_dir: str, rank: int, job: str | None) -> AttemptLog:
        from vertexrt import paths

        return cls(paths.join(checkpoint_dir, "attempts", f"rank-{rank}"), job=job)

    def previous(self) -> Attempt | None:
        """The newest record, when it belongs to this job; a corrupt one is removed with a warning."""
        names = self._names()
        if not names:
            return None
        newest = names[-1]
        try:
            record = self._read(newest)
        except (ValueError, OSError, RecursionError) as err:
            logger.warning(
                "crash-loop guard: the attempt record %s is unreadable (%s): removed; the attempt log starts "
                "afresh (nothing to fix unless this repeats: then check what else writes under %s)",
                self._uri(newest),
                err,
                self.directory,
            )
            self._remove([newest])
            return None
        return record if record.job == self.job else None

    def history(self) -> list[Attempt]:
        """This job's readable records, oldest first (at most :data:`KEPT_RECORDS`); unreadable ones are
        skipped (``previous()`` reports and removes the newest when it is one)."""
        records = []
        for name in self._names():
            try:
                record = self._read(name)
            except (ValueError, OSError, RecursionError) as err:
                logger.debug("attempt record %s skipped: %s", self._uri(name), err)
                continue
            if record.job == self.job:
                records.append(record)
        return records

    def append(self, attempt: Attempt) -> str:
        """Write ``attempt`` as a new record (its own object); keep the newest :data:`KEPT_RECORDS`.
        Returns its URI."""
        from vertexrt import paths

        name = f"{time.time_ns():020d}-{os.getpid()}.json"
        uri = self._uri(name)
        with paths.open(uri, "w") as f:
            f.write(json.dumps(asdict(attempt), sort_keys=True))
        names = self._names()
        self._remove(names[: max(0, len(names) - KEPT_RECORDS)])
        return uri

    def _uri(self, name: str) -> str:
        from vertexrt import paths

        return paths.join(self.directory, name)

    def _names(self) -> list[str]:
        from vertexrt import paths

        fs, path = paths.filesystem(self.directory)
        try:
            entries = fs.ls(path, detail=False)
        except FileNotFoundError:
            return []
        names = (str(e).rstrip("/").rsplit("/", 1)[-1] for e in entries)
        return sorted(n for n in names if n.endswith(".json"))

    def _read(self, name: str) -> Attempt:
        from vertexrt import paths

        with paths.open(self._uri(name), "rb") as f:
            raw = f.read(MAX_RECORD_BYTES + 1)
        if len(raw) > MAX_RECORD_BYTES:
            raise ValueError(f"larger than {MAX_RECORD_BYTES} bytes")
        return _attempt(json.loads(raw.decode()))

    def _remove(self, names: list[str]) -> None:
        from vertexrt import paths

        fs, _ = paths.filesystem(self.directory)
        for name in names:
            try:
                fs.rm(paths.filesystem(self._uri(name))[1])
            except OSError as err:
                logger.debug("crash-loop guard: could not remove %s: %s", self._uri(name), err)


def _attempt(value: object) -> Attempt:
    """An :class:`Attempt` from a decoded record, checked field by field."""
    if not isinstance(value, dict):
        raise ValueError("not a JSON object")
    outcome, job, step = value.get("outcome"), value.get("job"), value.get("step")
    if outcome not in _OUTCOMES:
        raise ValueError(f"outcome {str(outcome)[:40]!r} is not one of {', '.join(_OUTCOMES)}")
    if job is not None and not isinstance(job, str):
        raise ValueError("job is not a string")
    if step is not None and (isinstance(step, bool) or not isinstance(step, int) or not 0 <= step < 1 << 63):
        raise ValueError(f"step {str(step)[:40]!r} is not a step number")
    text = {k: value.get(k) for k in ("fingerprint", "error", "replica")}
    if any(v is not None and not isinstance(v, str) for v in text.values()):
        raise ValueError("fingerprint, error and replica must be strings")
    when, started = value.get("time", 0.0), value.get("started", 0.0)
    for name, number in (("time", when), ("started", started)):
        if isinstance(number, bool) or not isinstance(number, (int, float)) or not math.isfinite(number):
            raise ValueError(f"{name} is not a number")
    return Attempt(
        outcome=outcome,
        job=job,
        step=step,
        fingerprint=text["fingerprint"],
        error=text["error"] or "",
        replica=text["replica"] or "",
        time=float(when),
        started=float(started),
    )


class CrashLoopGuard:
    """What ``@main`` asks when an attempt ends: record it, and say whether it repeats the previous one."""

    def __init__(self, log: AttemptLog, *, replica: str, rank: int, started: float | None = None) -> None:
        self.log = log
        self.replica = replica
        self.rank = rank
        self.started = time.time() if started is None else started  # this attempt's start

    def failed(self, err: BaseException, step: int | None) -> str | None:
        """Record the failure ``err`` after ``step``; the crash-loop message when the previous attempt of
        this rank failed the same way after the same step, else ``None``."""
        error = f"{type(err).__name__}: {err}"[:_MAX_TEXT]
        return self._judge(fingerprint(err), error, step, "traceback above")

    def hung(self, step: int | None, where: str) -> int | None:
        """The hang watchdog fired after ``step`` with the main thread in ``where`` (``file:function``):
        record it; :data:`CRASH_LOOP_EXIT_CODE` when the previous attempt hung there too, else ``None``."""
        message = self._judge(f"hang@{where}", f"no progress, stuck in {where}", step, "stacks above")
        if message is None:
            return None
        logger.error("%s", message)
        return CRASH_LOOP_EXIT_CODE

    def _judge(self, print_: str, error: str, step: int | None, evidence: str) -> str | None:
        attempt = Attempt(
            "failed", self.log.job, step, print_, error, self.replica, time.time(), self.started
        )
        previous = self._quietly(self.log.previous)
        self._quietly(lambda: self.log.append(attempt))
        if previous is None or not previous.same_failure(attempt):
            return None
        at = "before the first step" if step is None else f"after step {step}"
        return (
            f"crash loop: replica {self.replica} (rank {self.rank}) failed {at} with {error} [{print_}], "
            f"the same failure at the same step as in its previous attempt (attempt log "
            f"{self.log.directory}). Restarting would fail the same way and spend Vertex's restart budget "
            f"(5 restarts per worker, then 3 retries of the job), so this replica exits "
            f"{CRASH_LOOP_EXIT_CODE}, which Vertex treats as permanent. Fix the error ({evidence}) and "
            f"resubmit; {SWITCH_VARIABLE}=0 lets the platform restart it anyway."
        )

    def preempted(self, step: int | None) -> None:
        """Record a preemption: it ends the chain of failures."""
        attempt = Attempt(
            "preempted", self.log.job, step, replica=self.replica, time=time.time(), started=self.started
        )
        self._quietly(lambda: self.log.append(attempt))

    def _quietly(self, action: Callable[[], T]) -> T | None:
        """Run ``action``; a log that cannot be reached is a warning, never a second failure."""
        try:
            return action()
        except Exception as err:
            logger.warning(
                "crash-loop guard: the attempt log %s cannot be used (%s: %s); this attempt is not judged",
                self.log.directory,
                type(err).__name__,
                err,
            )
            return None


def guard(checkpoint_dir: str, *, rank: int, replica: str, job: str | None) -> CrashLoopGuard | None:
    """The guard of this rank, or ``None`` when it is turned off or the run has no job ID (no platform
    restarts it)."""
    if not enabled() or not job:
        return None
    return CrashLoopGuard(AttemptLog.for_rank(checkpoint_dir, rank, job), replica=replica, rank=rank)


def mean_time_between_failures(records: list[Attempt]) -> tuple[float, int] | None:
    """``(seconds, failures)``: the uptime of ``records`` (those that know their start) per ``failed`` one
    among them; None without such a failure. A preemption adds uptime, not a failure."""
    known = [r for r in records if 0 < r.started <= r.time]
    failures = sum(r.outcome == "failed" for r in known)
    if not failures:
        return None
    return sum(r.time - r.started for r in known) / failures, failures


def job_mean_time_between_failures(
    checkpoint_dir: str, *, rank: int, job: str | None
) -> tuple[float, int] | None:
    """:func:`mean_time_between_failures` of ``rank``'s attempt log for ``job``; None when the guard is off
    or the run has no job ID (nothing is recorded then), and when the log cannot be read (a warning)."""
    if not enabled() or not job:
        return None
    log = AttemptLog.for_rank(checkpoint_dir, rank, job)
    try:
        return mean_time_between_failures(log.history())
    except Exception as err:
        logger.warning(
            "the attempt log %s cannot be read (%s: %s): no observed time between failures",
            log.directory,
            type(err).__name__,
            err,
        )
        return None

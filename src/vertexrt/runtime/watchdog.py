"""Hang watchdog: end a replica that stopped making progress, with every thread's stack in the log.

A silent hang (a rank stuck in a collective, a dead data loader) never exits, so Vertex never restarts it.
``HangWatchdog`` is fed once per step: ``beat(step)`` is a clock read and two attribute stores (no lock, no
system call). A daemon thread looks every few seconds; after ``timeout`` seconds without a beat it logs one
ERROR naming the replica and the last completed step, dumps every thread's Python stack (faulthandler) and
the last collectives of torch.distributed's flight recorder, and ends the process with ``HANG_EXIT_CODE``
(``os._exit``: the main thread is stuck), which Vertex treats as transient: it restarts the replica and the
job resumes from its last checkpoint.

The countdown starts at the first completed step (``beat(step)``): what comes before it (restoring,
compiling the first step, workers starting) is never a hang, and a process that never beats is never
ended. Time inside a :func:`vertexrt.phases.long_phase` (evaluation, checkpoint saves, DataLoader start-up,
``equalize`` counting) does not count: the countdown starts again when the phase ends (a hang inside one is
left to Vertex's job timeout). When it fires, the process's ``multiprocessing`` children (DataLoader
workers) are killed first, so none is left behind. Should the main thread hang while holding the GIL, a
C-level backstop (``faulthandler.dump_traceback_later``) dumps the stacks and exits with code 1 a little
later. ``start()`` also turns on torch's flight recorder for process groups
created after it (``TORCH_FR_BUFFER_SIZE``, unless already set).

Example:
    >>> wd = HangWatchdog(timeout=1800, replica="workerpool0-0").start()
    >>> for step in range(1, 101):
    ...     train_step()  # doctest: +SKIP
    ...     wd.beat(step)
    >>> with vertexrt.phases.long_phase("evaluation"):
    ...     evaluate()  # doctest: +SKIP
    >>> wd.stop()
"""

from __future__ import annotations

import faulthandler
import json
import logging
import os
import sys
import threading
import time
from collections.abc import Callable
from types import TracebackType

from vertexrt import audit
from vertexrt.errors import ConfigError
from vertexrt.phases import current_phase

logger = logging.getLogger(__name__)

#: Seconds without progress before the watchdog fires, from the environment (``0`` or ``off``: never).
TIMEOUT_VARIABLE = "VERTEXRT_HANG_TIMEOUT"
DEFAULT_TIMEOUT = 1800.0
MIN_TIMEOUT = 1.0  # below a second a limit is a typo (1e-320), not a choice
MAX_TIMEOUT = 7 * 24 * 3600.0  # Vertex's default job timeout
#: SIGABRT's code: the exit code Vertex documents as transient (the job is retried, not failed for good).
HANG_EXIT_CODE = 134
#: Flight-recorder entries kept per process when the user has not chosen (torch records nothing by default).
FLIGHT_RECORDER_ENTRIES = "256"
_SHOWN_COLLECTIVES = 8
_OFF = frozenset({"0", "off", "none", "false"})


def hang_timeout(explicit: float | None = None) -> float | None:
    """Seconds without progress before a hang is declared; ``None`` when the watchdog is off.

    ``explicit`` wins (``0`` turns it off); else ``$VERTEXRT_HANG_TIMEOUT``; else 1800 (30 minutes).

    Example:
        >>> hang_timeout(600.0)
        600.0

    Raises:
        ConfigError: the value is not 0 or a number of seconds between 1 and 7 days.
    """
    if explicit is not None:
        return _checked(float(explicit), f"timeout={explicit!r}")
    text = os.environ.get(TIMEOUT_VARIABLE, "").strip()
    if not text:
        return DEFAULT_TIMEOUT
    if text.lower() in _OFF:
        return None
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    return _checked(value, f"{TIMEOUT_VARIABLE}={text[:40]!r}")


def _checked(value: float, where: str) -> float | None:
    if value == 0:
        return None
    if not MIN_TIMEOUT <= value <= MAX_TIMEOUT:  # also rejects NaN and infinities
        raise ConfigError(
            f"{where}: give the seconds without progress before a hang is declared, a number from "
            f"{MIN_TIMEOUT:.0f} to {MAX_TIMEOUT:.0f} (7 days), or 0 to turn the hang watchdog off "
            f"({TIMEOUT_VARIABLE}=0)"
        )
    return value


class HangWatchdog:
    """Ends this process when ``beat()`` has not been called for ``timeout`` seconds.

    Args:
        timeout: seconds without progress; default ``hang_timeout()`` (``$VERTEXRT_HANG_TIMEOUT`` or 30
            minutes; ``0``/``off`` turns the watchdog off, and then every method does nothing).
        replica: the name in the ERROR line, e.g. ``ctx.replica``; default the cluster's, read at ``start()``.
        exit_code: the process's exit code when it fires.
    """

    def __init__(
        self, timeout: float | None = None, *, replica: str | None = None, exit_code: int = HANG_EXIT_CODE
    ) -> None:
        self.timeout = hang_timeout(timeout)
        self.replica = replica
        self.exit_code = exit_code
        self._last: float | None = None  # monotonic time of the last beat; None: not armed yet
        self._step: int | None = None
        #: Asked when the watchdog fires, with the last step and the main thread's innermost frame
        #: (``file:function``): another exit code, or ``None`` for ``exit_code`` (the crash-loop guard).
        self.judge: Callable[[int | None, str], int | None] | None = None
        self._stopped = threading.Event()
        self._thread: threading.Thread | None = None

    def beat(self, step: int | None = None) -> None:
        """Record progress: ``step`` completed (it arms the countdown, and is shown when the watchdog
        fires); without a step, progress within a step (an armed countdown starts again, else nothing)."""
        if step is not None:
            self._step = step
            self._last = time.monotonic()
            audit.step(step)
        elif self._last is not None:
            self._last = time.monotonic()

    @property
    def last_step(self) -> int | None:
        """The last step reported to :meth:`beat`, or ``None`` before the first."""
        return self._step

    def start(self) -> HangWatchdog:
        """Start the watching thread (once; the countdown begins at the first ``beat(step)``); returns
        ``self``."""
        if self.timeout is None or self._thread is not None:
            return self
        if self.replica is None:
            self.replica = _replica_name()
        _enable_flight_recorder()
        self._stopped.clear()
        self._thread = threading.Thread(target=self._watch, name="vertexrt-hang-watchdog", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop watching (e.g. before an export, after the last step; a pause is :func:`long_phase`)."""
        thread, self._thread = self._thread, None
        self._last = None  # a later start() re-arms at its first beat
        if thread is None:
            return
        self._stopped.set()
        if thread is not threading.current_thread():
            thread.join()
        faulthandler.cancel_dump_traceback_later()

    def __enter__(self) -> HangWatchdog:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    def _watch(self) -> None:
        timeout = self.timeout
        assert timeout is not None
        poll = min(max(timeout / 20, 0.05), 5.0)
        backstop = min(max(timeout / 10, 5.0), 120.0)  # after the Python thread would have fired
        armed_at: float | None = None
        while not self._stopped.wait(poll):
            last = self._last
            if last is None:
                continue
            phase, phase_ended = current_phase()
            if phase is not None:  # not a hang: the countdown starts again when the phase ends
                if armed_at is not None:
                    faulthandler.cancel_dump_traceback_later()
                    armed_at = None
                continue
            last = max(last, phase_ended)
            idle = time.monotonic() - last
            if idle >= timeout:
                self._fire(idle)
            if last != armed_at:
                armed_at = last
                faulthandler.dump_traceback_later(timeout - idle + backstop, exit=True, file=_stderr_fd())

    def _fire(self, idle: float) -> None:
        fd = _stderr_fd()
        faulthandler.dump_traceback_later(60.0, exit=True, file=fd)  # should the dump below hang
        last = "none yet" if self._step is None else str(self._step)
        logger.error(
            "hang watchdog: no training progress for %.0f s on replica %s (last completed step: %s); "
            "dumping every thread's stack and exiting with code %d so that Vertex restarts the replica, "
            "which resumes from its last checkpoint. Change the limit with %s (seconds; 0 turns it off)",
            idle,
            self.replica,
            last,
            self.exit_code,
            TIMEOUT_VARIABLE,
        )
        os.write(fd, f"hang watchdog: stacks of replica {self.replica}, most recent call first:\n".encode())
        faulthandler.dump_traceback(file=fd, all_threads=True)
        collectives = last_collectives()
        if collectives:
            logger.error(
                "hang watchdog: last collectives on replica %s (torch.distributed flight recorder, newest "
                "last):\n  %s",
                self.replica,
                "\n  ".join(collectives),
            )
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError, AttributeError):
                pass
        _kill_children()
        code = self.judge(self._step, _main_thread_frame()) if self.judge is not None else None
        os._exit(self.exit_code if code is None else code)


def _main_thread_frame() -> str:
    """``dir/file.py:function`` where the main thread is now (``?`` when it cannot be seen)."""
    frame = sys._current_frames().get(threading.main_thread().ident or -1)
    if frame is None:
        return "?"
    where = "/".join(frame.f_code.co_filename.replace(os.sep, "/").split("/")[-2:])
    return f"{where}:{frame.f_code.co_name}"


_PROCESS_WATCHDOG: list[HangWatchdog] = []


def process_watchdog(replica: str | None = None) -> HangWatchdog:
    """The process's one hang watchdog, started; created on first use (``replica`` names it in the log).

    The Trainer, ``Context.step()`` and the Keras callbacks all feed this one, so a process never has two
    countdowns.
    """
    if not _PROCESS_WATCHDOG:
        _PROCESS_WATCHDOG.append(HangWatchdog(replica=replica))
    return _PROCESS_WATCHDOG[0].start()


def last_collectives(limit: int = _SHOWN_COLLECTIVES) -> list[str]:
    """The newest ``limit`` collectives of torch.distributed's flight recorder, one line each.

    Empty when torch.distributed is not initialised or records nothing (``TORCH_FR_BUFFER_SIZE`` unset
    before the process group was created).

    Example:
        >>> last_collectives()  # doctest: +SKIP
        ['gloo:all_reduce seq=41 pg=default_pg sizes=[[3]] state=scheduled']
    """
    dist = sys.modules.get("torch.distributed")
    if dist is None:
        return []
    try:
        if not dist.is_initialized():
            return []
        from torch._C._distributed_c10d import _dump_fr_trace_json  # type: ignore[attr-defined]

        entries = json.loads(_dump_fr_trace_json(True, False)).get("entries", [])
    except Exception as err:  # a torch without the flight recorder: the stacks still say where
        logger.debug("no flight recorder: %s", err)
        return []
    lines = []
    for entry in entries[-limit:]:
        group = entry.get("process_group") or ["", "?"]
        lines.append(
            f"{entry.get('profiling_name', '?')} seq={entry.get('collective_seq_id', '?')} pg={group[-1]} "
            f"sizes={entry.get('input_sizes', '?')} state={entry.get('state', '?')}"
        )
    return lines


def _kill_children() -> None:
    """SIGKILL this process's ``multiprocessing`` children (DataLoader workers): ``os._exit`` skips the
    clean-up that ends them, and a worker stuck inside the user's dataset never notices its parent is gone."""
    multiprocessing = sys.modules.get("multiprocessing")
    if multiprocessing is None:
        return
    for child in multiprocessing.active_children():
        try:
            child.kill()
        except (OSError, ValueError, AttributeError) as err:  # gone meanwhile, or not ours to end
            logger.debug("hang watchdog: could not end child %s: %s", child.pid, err)


def _enable_flight_recorder() -> None:
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        return  # too late for this process group; set TORCH_FR_BUFFER_SIZE before init_process_group
    os.environ.setdefault("TORCH_FR_BUFFER_SIZE", FLIGHT_RECORDER_ENTRIES)


def _replica_name() -> str:
    try:
        from vertexrt.distributed import cluster, world_info

        where = cluster()
        pool = where.pool(where.role)
        return f"{pool.name if pool else where.role}-{where.task_index} rank {world_info().rank}"
    except Exception:  # the ERROR line must not depend on a readable cluster description
        import socket

        return f"{socket.gethostname()} pid {os.getpid()}"


def _stderr_fd() -> int:
    try:
        return sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):
        return 2

"""The one owner of SIGTERM (Vertex's preemption notice) in this process.

Everything that wants to hear about a preemption (the checkpoint manager, ``@main``, the Trainer, the Keras
callbacks) subscribes here instead of calling ``signal.signal`` itself. The first subscription snapshots the
handler that was there and installs a flag-only handler; the last release puts the snapshot back, whatever
order the subscribers close in. The flag is process-wide: every subscriber sees the same notice.
A library may take the signal below Python after that (TensorFlow's multi-worker runtime installs a C
handler when ``MultiWorkerMirroredStrategy`` starts, while ``signal.getsignal`` still names ours):
:meth:`PreemptionSignal.reassert` checks the C-level handler and puts ours back; ``@main`` calls it after
setting up TensorFlow, and every later subscription does too.
Agreement across ranks is :class:`vertexrt.preemption.vote.StopVote`'s job, not this module's.

Example:
    >>> notice = preemption_signal().subscribe()
    >>> notice.requested          # polled: True once SIGTERM arrived
    False
    >>> notice.close()            # the last close restores the original handler
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from collections.abc import Callable
from types import FrameType, TracebackType
from typing import Any

from vertexrt.errors import ConfigError

log = logging.getLogger(__name__)

#: The exit status of a process that stopped because of SIGTERM (128 + 15): Vertex restarts the replica.
PREEMPTED_EXIT_CODE = 128 + signal.SIGTERM


class PreemptionSignal:
    """A flag set by ``signum`` (default SIGTERM), installed while at least one subscription is open."""

    def __init__(self, signum: int = signal.SIGTERM) -> None:
        self.signum = signum
        self._lock = threading.Lock()
        self._subscribers = 0
        self._original: Any = None
        self._installed = False
        self._requested = False
        self._polled = False
        self._arrived_at: float | None = None
        self._handler = self._handle  # one bound method: each `self._handle` is a new object (`is` fails)
        self._c_handler: int | None = None  # the C-level address of Python's handler once ours is installed

    @property
    def installed(self) -> bool:
        """True while the flag handler is this process's handler for ``signum``."""
        return self._installed

    @property
    def requested(self) -> bool:
        """True once the signal arrived (or :meth:`request` was called); does not count as a poll."""
        return self._requested

    @property
    def arrived_at(self) -> float | None:
        """``time.time()`` when the first notice arrived, else None."""
        return self._arrived_at

    @property
    def unpolled(self) -> bool:
        """True when a notice arrived and nobody has asked about it since (see :meth:`poll`)."""
        return self._requested and not self._polled

    def poll(self) -> bool:
        """Whether a notice arrived; a True answer marks the notice as seen by the training loop."""
        if self._requested:
            self._polled = True
        return self._requested

    def request(self) -> None:
        """Set the flag as if the signal had arrived (e.g. a stop decided by another rank)."""
        if self._arrived_at is None:
            self._arrived_at = time.time()
        self._requested = True

    def subscribe(self) -> Subscription:
        """Register interest; the first subscription installs the handler (from the main thread)."""
        with self._lock:
            if not self._installed:
                if threading.current_thread() is not threading.main_thread():
                    raise ConfigError(
                        "the preemption (SIGTERM) handler must be installed from the main thread (where "
                        "Python runs signal handlers): create the CheckpointManager or call fit() there"
                    )
                self._original = signal.signal(self.signum, self._handler)
                self._c_handler = _c_level_handler(self.signum)
                self._installed = True
            else:
                self._reassert()
            self._subscribers += 1
        return Subscription(self)

    def reassert(self) -> bool:
        """Put the flag handler back if something replaced it below Python; True when it had to.

        Call from the main thread after a library that installs C-level signal handlers has started
        (TensorFlow's ``MultiWorkerMirroredStrategy``). Nothing happens while no subscription is open.
        """
        with self._lock:
            return self._reassert()

    def _reassert(self) -> bool:
        if not self._installed or threading.current_thread() is not threading.main_thread():
            return False
        if signal.getsignal(self.signum) is not self._handler:  # replaced from Python: theirs chains to ours
            return False
        now = _c_level_handler(self.signum)
        if now is not None and now == self._c_handler:
            return False
        signal.signal(self.signum, self._handler)  # sigaction again: Python's C handler, which runs ours
        self._c_handler = _c_level_handler(self.signum)
        if now is not None:  # unknown (no sigaction to ask): re-installed quietly, just in case
            log.info(
                "%s was taken below Python (a C library's handler): vertexrt's handler is back", _name(self)
            )
        return True

    def _release(self) -> None:
        with self._lock:
            self._subscribers -= 1
            if self._subscribers > 0 or not self._installed:
                return
            if threading.current_thread() is not threading.main_thread():
                log.warning("the SIGTERM handler is released off the main thread: it stays installed")
                self._subscribers = 0
                return
            if signal.getsignal(self.signum) is self._handler:
                signal.signal(self.signum, self._original if self._original is not None else signal.SIG_DFL)
            else:  # somebody installed theirs over ours: theirs stays (ours chains to the original)
                log.debug("SIGTERM handler replaced by another owner; leaving it in place")
            self._installed = False
            self._requested = self._polled = False
            self._arrived_at = None

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        # No lock, no I/O: the handler may run between any two bytecodes of the main thread.
        if self._arrived_at is None:
            self._arrived_at = time.time()
        self._requested = True
        original = self._original
        if callable(original) and original is not signal.default_int_handler:
            original(signum, frame)


class Subscription:
    """One subscriber's handle: ``requested`` polls the shared flag; ``close()`` releases (idempotent)."""

    def __init__(self, owner: PreemptionSignal) -> None:
        self._owner: PreemptionSignal | None = owner

    @property
    def requested(self) -> bool:
        """True once a notice arrived (counts as a poll); False after ``close()``."""
        return self._owner is not None and self._owner.poll()

    def close(self) -> None:
        owner, self._owner = self._owner, None
        if owner is not None:
            owner._release()

    def __enter__(self) -> Subscription:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


class UnpolledWatch:
    """Calls ``warn(seconds)`` once (from a daemon thread) when a notice stays unpolled ``after`` seconds.

    Vertex sends SIGKILL ~15 s after SIGTERM: a loop that never polls should be told while there is time.

    Example:
        >>> watch = UnpolledWatch(preemption_signal(), after=5.0, warn=print)
        >>> watch.stop()
    """

    def __init__(self, owner: PreemptionSignal, *, after: float, warn: Callable[[float], None]) -> None:
        self._owner, self._after, self._warn = owner, after, warn
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="vertexrt-preemption-watch", daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        while not self._stopped.wait(0.5):
            arrived = self._owner.arrived_at
            if arrived is None or not self._owner.unpolled:
                continue
            waited = time.time() - arrived
            if waited >= self._after:
                self._warn(waited)
                return

    def stop(self) -> None:
        """End the watch (idempotent); returns at once."""
        self._stopped.set()


def _name(owner: PreemptionSignal) -> str:
    return signal.Signals(owner.signum).name


def _c_level_handler(signum: int) -> int | None:
    """The address of the C handler of ``signum`` (sigaction), or None where it cannot be read."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        action = ctypes.create_string_buffer(512)  # larger than any platform's struct sigaction
        if libc.sigaction(signum, None, action) != 0:
            return None
        return ctypes.c_void_p.from_buffer(action).value or 0  # the handler is its first member
    except (OSError, AttributeError):
        return None


_SIGTERM = PreemptionSignal()


def preemption_signal() -> PreemptionSignal:
    """The process-wide owner of SIGTERM."""
    return _SIGTERM

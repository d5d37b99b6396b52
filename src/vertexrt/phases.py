"""Long phases that are not hangs: evaluation, a checkpoint save, DataLoader workers starting, counting.

Code that may run long without a training step wraps that work in :func:`long_phase`. The hang watchdog
(:mod:`vertexrt.runtime.watchdog`) does not count the time spent inside one and restarts its countdown
when the last one ends, so a healthy slow phase is never mistaken for a hang (and Vertex never restarts a
replica into the same slow phase again). This module sits below every layer and imports nothing of
vertexrt, so that ``checkpoint/`` and ``data/`` can mark their phases without importing ``runtime/``.

Entering and leaving a phase is a lock and a clock read: meant for work that takes seconds, not per record.

Example:
    >>> with long_phase("export"):
    ...     pass
    >>> current_phase()[0] is None
    True
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

_lock = threading.Lock()
_running: list[str] = []  # one entry per phase in progress (any thread), innermost last
_ended = [0.0]  # monotonic time the last phase ended (0.0: none yet)


@contextmanager
def long_phase(what: str) -> Iterator[None]:
    """Mark the work inside the ``with`` block as a phase that may take long without a training step.

    ``what`` names it (e.g. ``"evaluation"``); phases may nest and run on several threads at once.
    """
    with _lock:
        _running.append(what)
    try:
        yield
    finally:
        with _lock:
            _running.remove(what)
            _ended[0] = time.monotonic()


def current_phase() -> tuple[str | None, float]:
    """``(the innermost phase in progress or None, monotonic time the last phase ended, 0.0 if none)``."""
    with _lock:
        return (_running[-1] if _running else None), _ended[0]

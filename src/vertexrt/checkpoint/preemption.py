"""A SIGTERM handler that only sets a flag, chaining the handler it replaces.

The training loop polls the flag at step boundaries (and inside eval/warm-up loops), saves synchronously and
exits with ``128 + SIGTERM``. No I/O or collective runs inside the handler.

Example:
    >>> notice = PreemptionNotice().install()
    >>> if notice.requested: ...
"""

from __future__ import annotations

import logging
import signal
import threading
from types import FrameType
from typing import Any

from vertexrt.errors import ConfigError

log = logging.getLogger(__name__)

EXIT_CODE = 128 + signal.SIGTERM


class PreemptionNotice:
    """Sets ``requested`` on ``signum`` (default SIGTERM); ``uninstall()`` puts the previous handler back."""

    def __init__(self, signum: int = signal.SIGTERM) -> None:
        self.signum = signum
        self.requested = False
        self._previous: Any = None
        self._installed = False

    def install(self) -> PreemptionNotice:
        if self._installed:
            return self
        if threading.current_thread() is not threading.main_thread():
            raise ConfigError(
                "save_on_preemption() must be called from the main thread (Python delivers signals there)"
            )
        self._previous = signal.signal(self.signum, self._handle)
        self._installed = True
        return self

    def uninstall(self) -> None:
        if self._installed and threading.current_thread() is threading.main_thread():
            signal.signal(self.signum, self._previous if self._previous is not None else signal.SIG_DFL)
            self._installed = False

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self.requested = True
        previous = self._previous
        if callable(previous) and previous not in (signal.default_int_handler,):
            previous(signum, frame)

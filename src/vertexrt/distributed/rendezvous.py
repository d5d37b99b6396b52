"""Patient rendezvous: wait for the chief's address, and count who joined, under one deadline.

Vertex starts a job's replicas in parallel, but their VMs come up minutes apart, and the chief's host name
may not resolve at first. Before a process group or a multi-worker strategy starts, a worker waits for the
chief's address (DNS, then a TCP connect, with back-off), logging how long it has waited. The wait ends at
the rendezvous deadline, ``VERTEXRT_RENDEZVOUS_TIMEOUT`` seconds (default 30 minutes), which is separate
from the timeout of the collectives that follow.

Example:
    >>> from vertexrt.distributed import rendezvous
    >>> deadline = rendezvous.Deadline.from_environment({"VERTEXRT_RENDEZVOUS_TIMEOUT": "120"})
    >>> deadline.seconds
    120.0
    >>> rendezvous.wait_for_address("chief-host", 2222, deadline)  # doctest: +SKIP
"""

from __future__ import annotations

import logging
import os
import socket
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from vertexrt.errors import ConfigError, RendezvousTimeout

logger = logging.getLogger(__name__)

VARIABLE = "VERTEXRT_RENDEZVOUS_TIMEOUT"
DEFAULT_SECONDS = 30 * 60.0
_MAX_SECONDS = 7 * 24 * 3600.0
_PROBE_SECONDS = 2.0  # one TCP connect attempt
_FIRST_PAUSE, _MAX_PAUSE = 0.1, 5.0  # back-off between attempts
_MAX_COUNT_PAUSE = 1.0  # a count is one cheap store request: the last joiner waits at most ~1 s more
_FIRST_LOG, _MAX_LOG_GAP = 2.0, 60.0  # progress lines at 2, 4, 8 ... s, then every minute


@dataclass(frozen=True)
class Deadline:
    """When the rendezvous must be over (``time.monotonic()`` based), and how long it was given."""

    seconds: float
    started: float

    @classmethod
    def from_environment(cls, environ: Mapping[str, str] | None = None) -> Deadline:
        """``VERTEXRT_RENDEZVOUS_TIMEOUT`` seconds from now (default 1800).

        Raises:
            ConfigError: the value is not a number of seconds > 0 and <= 7 days.
        """
        text = (os.environ if environ is None else environ).get(VARIABLE)
        if text is None or not text.strip():
            return cls(DEFAULT_SECONDS, time.monotonic())
        try:
            seconds = float(text)
        except ValueError:
            seconds = float("nan")
        if not 0 < seconds <= _MAX_SECONDS:
            raise ConfigError(
                f"{VARIABLE}={text[:64]!r}: expected the rendezvous deadline in seconds, > 0 and <= "
                f"{_MAX_SECONDS:.0f} (default {DEFAULT_SECONDS:.0f})"
            )
        return cls(seconds, time.monotonic())

    def elapsed(self) -> float:
        return time.monotonic() - self.started

    def remaining(self) -> float:
        return self.seconds - self.elapsed()


class _Progress:
    """Logs a line at 2, 4, 8 ... seconds of waiting, then once a minute."""

    def __init__(self, deadline: Deadline) -> None:
        self.deadline = deadline
        self.next = _FIRST_LOG

    def due(self) -> bool:
        if self.deadline.elapsed() < self.next:
            return False
        self.next = min(self.next * 2, self.next + _MAX_LOG_GAP)
        return True

    def pause(self, backoff: float) -> None:
        """Sleep ``backoff`` seconds, but wake for the next progress line and the deadline."""
        until_log = self.next - self.deadline.elapsed()
        time.sleep(max(min(backoff, until_log, self.deadline.remaining()), 0.0))


def probe(host: str, port: int, timeout: float = _PROBE_SECONDS) -> str | None:
    """``None`` when ``host:port`` resolves and accepts a TCP connection, else why not."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as err:
        return f"the name does not resolve ({err})"
    reasons = []
    for family, kind, proto, _, address in infos:
        try:
            with socket.socket(family, kind, proto) as sock:
                sock.settimeout(timeout)
                sock.connect(address)
                return None
        except OSError as err:
            reasons.append(f"{address[0]}: {err.strerror or err}")
    return "no connection (" + "; ".join(reasons) + ")"


def wait_for_address(host: str, port: int, deadline: Deadline, what: str = "the chief") -> None:
    """Return once ``host:port`` resolves and accepts a connection; log while waiting.

    Raises:
        RendezvousTimeout: the deadline passed first (the message names the address and the variable).
    """
    pause = _FIRST_PAUSE
    progress = _Progress(deadline)
    while True:
        reason = probe(host, port, min(_PROBE_SECONDS, max(deadline.remaining(), 0.1)))
        if reason is None:
            if deadline.elapsed() >= _FIRST_LOG:
                logger.info("%s at %s:%d answered after %.0f s", what, host, port, deadline.elapsed())
            return
        if deadline.remaining() <= 0:
            raise RendezvousTimeout(
                f"rendezvous: {what} at {host}:{port} did not answer within {deadline.seconds:g} s "
                f"({reason}). Check that {what} started and that the address is right (MASTER_ADDR/"
                f"MASTER_PORT, CLUSTER_SPEC); a slow start needs a longer {VARIABLE} (seconds)"
            )
        if progress.due():
            logger.info("waiting for %s at %s:%d, %.0f s (%s)", what, host, port, deadline.elapsed(), reason)
        progress.pause(pause)
        pause = min(pause * 2, _MAX_PAUSE)


def wait_for_count(count: Callable[[], int], total: int, deadline: Deadline, noun: str = "replicas") -> None:
    """Return once ``count()`` reaches ``total``; log "k of N replicas joined" while waiting.

    Raises:
        RendezvousTimeout: the deadline passed first.
    """
    pause = _FIRST_PAUSE
    progress = _Progress(deadline)
    while True:
        joined = count()
        if joined >= total:
            return
        if deadline.remaining() <= 0:
            raise RendezvousTimeout(
                f"rendezvous: only {joined} of {total} {noun} joined within {deadline.seconds:g} s; check "
                f"the missing {noun}' logs, or give a slow start a longer {VARIABLE} (seconds)"
            )
        if progress.due():
            logger.info("%d of %d %s joined, %.0f s", joined, total, noun, deadline.elapsed())
        progress.pause(pause)
        pause = min(pause * 2, _MAX_COUNT_PAUSE)

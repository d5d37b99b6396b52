"""Writer tokens: the ``<host>-<pid>-<nonce>`` in every name a save creates, and whether its writer is gone.

A leftover (temp directory, un-committed file) is traced to its writer by the token in its name::

    token = new_token()                      # "worker_0-4242-1a2b3c4d5e6f7a8b"
    writer_gone(f".tmp.step_5.{token}", mtime=0.0, stale_after=600.0)  # False: this process is alive
"""

from __future__ import annotations

import os
import re
import time

_TOKEN = re.compile(r"([A-Za-z0-9_]+)-(\d+)-([0-9a-f]{8})")

#: This process's nonce, the first 8 hex digits after the PID in every token it makes: a leftover with this
#: host and PID but another nonce was written by an earlier process that had the same PID (a restarted
#: container often does). One value per process, so nothing grows with the number of saves.
_PROCESS_NONCE = os.urandom(4).hex()


def new_token() -> str:
    """``<host>-<pid>-<process nonce><save nonce>``: names all one save writes, traceable to its writer."""
    return f"{host_name()}-{os.getpid()}-{_PROCESS_NONCE}{os.urandom(4).hex()}"


def _reseed_after_fork() -> None:
    global _PROCESS_NONCE
    _PROCESS_NONCE = os.urandom(4).hex()


os.register_at_fork(after_in_child=_reseed_after_fork)


def host_name() -> str:
    """This machine's name as tokens carry it (characters outside ``[A-Za-z0-9_]`` become ``_``)."""
    import socket

    return re.sub(r"[^A-Za-z0-9_]", "_", socket.gethostname()) or "host"


def writer_gone(name: str, mtime: float, stale_after: float) -> bool:
    """True when the writer named in ``name`` (its token) is gone; False for names without one.

    On another host, a leftover counts as gone once it is ``stale_after`` seconds old (``mtime``).
    """
    match = _TOKEN.search(name)
    if not match:
        return False
    host, pid = match[1], int(match[2])
    if host != host_name():
        return time.time() - mtime > stale_after
    if pid == os.getpid():
        return match[3] != _PROCESS_NONCE
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False

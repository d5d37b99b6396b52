"""Find and kill every process a ``local-run`` job started, also after the launcher itself dies.

A process group is not enough: a replica's child may ``setsid`` out of it, and ``PR_SET_PDEATHSIG`` only
reaches the replica itself. So each replica's environment carries ``VERTEXRT_LOCAL_RUN_ID=<id>``, which
every process it starts inherits, and the launcher records each replica's session. A watchdog process
(``python -m vertexrt.distributed.reaper ID``) reads ``session PID`` lines from the launcher on stdin (and
``end PID`` once an attempt's teardown found a session empty: its id may be reused by then); when
that pipe closes (the launcher exited, or was SIGKILLed) it kills every process carrying the ID or living
in a recorded session. Linux only (``/proc``); elsewhere nothing is found.

Example:
    >>> from vertexrt.distributed import reaper
    >>> reaper.kill_all("no-such-run")
    0
"""

from __future__ import annotations

import os
import signal
import sys
import time
from collections.abc import Collection, Sequence
from pathlib import Path

#: The variable every process of one local-run job inherits.
RUN_ID_VARIABLE = "VERTEXRT_LOCAL_RUN_ID"
_ROUNDS = 100  # a forking process is chased this many times before giving up


def tracked(run_id: str, sessions: Collection[int] = (), skip_groups: Collection[int] = ()) -> list[int]:
    """Live (not zombie) processes whose environment carries ``run_id``, or in one of ``sessions``; none
    from the process groups ``skip_groups``."""
    needle = f"\0{RUN_ID_VARIABLE}={run_id}\0".encode()
    me = os.getpid()
    found = []
    for entry in Path("/proc").iterdir() if os.path.isdir("/proc") else ():
        if not entry.name.isdigit() or int(entry.name) == me:
            continue
        try:
            state, group, session = _stat(entry)
            if state in "ZX" or group in skip_groups:
                continue
            if session in sessions or needle in b"\0" + (entry / "environ").read_bytes():
                found.append(int(entry.name))
        except (OSError, ValueError, IndexError):
            continue  # gone, or another user's process
    return found


def _stat(entry: Path) -> tuple[str, int, int]:
    """State, process group and session of one ``/proc/<pid>``."""
    stat = (entry / "stat").read_text()
    fields = stat[stat.rindex(")") + 2 :].split()  # state ppid pgrp session ...
    return fields[0], int(fields[2]), int(fields[3])


def kill_all(
    run_id: str, sessions: Collection[int] = (), sig: int = signal.SIGKILL, skip_groups: Collection[int] = ()
) -> int:
    """Send ``sig`` to every :func:`tracked` process; with SIGKILL, repeat until none is left (a process
    may fork while it is being killed). Returns how many processes were signalled."""
    signalled: set[int] = set()
    for _ in range(_ROUNDS):
        found = tracked(run_id, sessions, skip_groups)
        pids = [p for p in found if sig == signal.SIGKILL or p not in signalled]
        if not pids:
            break
        for pid in pids:
            try:
                os.kill(pid, sig)
            except (ProcessLookupError, PermissionError):
                continue
            signalled.add(pid)
        if sig != signal.SIGKILL:
            break
        time.sleep(0.01)
    return len(signalled)


def main(argv: Sequence[str] | None = None) -> int:
    """The watchdog: ``python -m vertexrt.distributed.reaper RUN_ID`` with the launcher's pipe on stdin."""
    (run_id,) = sys.argv[1:] if argv is None else argv
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C reaches the launcher, which tears down
    sessions: set[int] = set()
    for line in sys.stdin.buffer:  # until the launcher closes the pipe or dies
        word, _, pid = line.decode().partition(" ")
        if not pid.strip().isdigit():
            continue
        if word == "session":
            sessions.add(int(pid))
        elif word == "end":
            sessions.discard(int(pid))
    kill_all(run_id, sessions)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""local-run with real process trees: nothing outlives the job (daemons, a killed launcher), and output is
relayed as it arrives, partial lines included."""

from __future__ import annotations

import io
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from jobs import CLUSTER_VARIABLES, MARK, Job, marked_processes, start_job

from vertexrt.distributed.launcher import OutputRelay

pytestmark = pytest.mark.slow


def _launcher(tmp_path: Path, *command: str) -> tuple[Job, str]:
    marker = uuid.uuid4().hex
    env = {k: v for k, v in os.environ.items() if k not in CLUSTER_VARIABLES}
    env.update({MARK: marker, "PYTHONUNBUFFERED": "1"})
    argv = [sys.executable, "-m", "vertexrt.distributed.launcher", "--grace", "1", "--", *command]
    return start_job(argv, tmp_path, env), marker


def _wait_for(predicate, timeout: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return predicate()


def _cleanup(job: Job, marker: str) -> list[int]:
    with job:
        pass  # the launcher, if it still runs, and its process group: killed
    left = marked_processes(marker)
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    return left


def test_a_daemon_that_left_the_process_group_does_not_survive_the_job(local_run) -> None:
    # `setsid` leaves the replica's process group (and session): killpg alone never reaches it.
    script = "setsid sleep 300 & setsid sh -c 'sleep 301 & wait' & echo started"
    run = local_run("--", "bash", "-c", script, timeout=60)  # fails the test if any process is left
    assert run.returncode == 0, run.output
    assert "[workerpool0-0] started" in run.output


def test_nothing_survives_a_sigkilled_launcher(tmp_path) -> None:
    script = "sleep 300 & setsid sleep 301 & (trap '' TERM; sleep 302) & echo started; wait"
    job, marker = _launcher(tmp_path, "bash", "-c", script)
    try:
        job.wait_for("[workerpool0-0] started", 30)
        assert len(marked_processes(marker)) >= 5  # launcher, watchdog, bash, three sleeps
        job.kill()  # no teardown can run in the launcher itself
        assert _wait_for(lambda: not marked_processes(marker)), [
            Path(f"/proc/{p}/cmdline").read_bytes() for p in marked_processes(marker)
        ]
    finally:
        assert not _cleanup(job, marker)


def test_partial_lines_are_relayed_before_the_replica_writes_a_newline(tmp_path) -> None:
    go = tmp_path / "go"
    code = (
        "import os, sys, time\n"
        "for i in range(43): sys.stdout.write(f'\\rprogress {i}%'); sys.stdout.flush()\n"
        f"while not os.path.exists({str(go)!r}): time.sleep(0.05)\n"
        "print(' done')\n"
    )
    job, marker = _launcher(tmp_path, sys.executable, "-c", code)
    try:
        job.wait_for("[workerpool0-0] progress 42%", 30)  # still no newline from the replica
        go.touch()
        done = job.wait(60)
    finally:
        assert not _cleanup(job, marker)
    seen = done.stdout
    assert done.returncode == 0, seen
    assert "\r[workerpool0-0] progress 1%\r[workerpool0-0] progress 2%" in seen
    assert "[workerpool0-0] progress 42% done\n" in seen


def test_relay_prefixes_every_line_and_holds_back_at_most_one_bounded_line() -> None:
    out = io.BytesIO()
    relay = OutputRelay(out)
    bar = b"".join(b"\r%3d%%|%s|" % (i, b"#" * (i // 10)) for i in range(101))
    for start in range(0, len(bar), 7):  # arbitrary read boundaries
        relay.feed("chief", bar[start : start + 7])
    relay.feed("chief", b"\r\n")
    lines = out.getvalue().split(b"\r")
    assert lines[0] == b"[chief] " and all(line.startswith(b"[chief] ") for line in lines[1:])
    assert out.getvalue().replace(b"[chief] ", b"") == bar + b"\r\n"

    out.seek(0), out.truncate()
    relay.feed("chief", b"x" * (1 << 16))  # no newline, but 64 KiB: written at once
    assert out.getvalue() == b"[chief] " + b"x" * (1 << 16)
    relay.feed("worker-0", b"a line\r")  # another replica: the open line is closed first
    relay.feed("worker-0", b"\nnext")  # \r\n split across two reads is one line end
    relay.feed("chief", b"y")
    assert out.getvalue().endswith(b"x\n[worker-0] a line\r\n")  # "next" and "y" wait for their ends
    relay.flush(older_than=0)  # ... but not for long
    relay.interrupt()
    relay.feed("chief", b"z\n")
    relay.close("chief")
    relay.close("worker-0")
    assert out.getvalue().endswith(b"\r\n[chief] y\n[worker-0] next\n[chief] z\n")


def test_the_reaper_forgets_the_sessions_of_a_finished_attempt() -> None:
    # The reaper's session list only grew: after a whole-job restart, a session id of the first attempt
    # (a pid, free for reuse once its processes are gone) still got SIGKILLed when the launcher exited.
    # Direct Popen here: a bystander session and a reaper fed on stdin are no jobs (jobs.py has no stdin).
    bystander = subprocess.Popen(["sleep", "60"], start_new_session=True)  # its pid leads its session
    try:
        reaper = subprocess.Popen(
            [sys.executable, "-m", "vertexrt.distributed.reaper", uuid.uuid4().hex], stdin=subprocess.PIPE
        )
        reaper.communicate(f"session {bystander.pid}\nend {bystander.pid}\n".encode(), timeout=30)
        assert reaper.returncode == 0
        assert bystander.poll() is None, "the reaper killed a session it had been told was over"
    finally:
        bystander.kill()
        bystander.wait()

"""A replica that behaves as told, to test local-run without a framework: ``behave.py MODE [ARG]``."""

import json
import os
import signal
import sys
import time
from pathlib import Path

mode = sys.argv[1]
if mode == "preempt":  # before anything slow, so the launcher's SIGTERM always finds the handler
    signal.signal(signal.SIGTERM, lambda *_: (print("got SIGTERM, saving", flush=True), sys.exit(143)))
elif mode == "finish_on_notice":
    signal.signal(signal.SIGTERM, lambda *_: (print("notice: finishing, exit 0", flush=True), sys.exit(0)))
elif mode == "notice_with_child":
    import subprocess

    child = None

    def check_child(*_: object) -> None:
        """A container runtime signals PID 1 only: a child in the replica's process group (a DataLoader
        worker) must still be alive when the main process handles the notice."""
        try:
            child.wait(timeout=2)  # type: ignore[union-attr]
            print(f"child died with {child.returncode}", flush=True)  # type: ignore[union-attr]
        except subprocess.TimeoutExpired:
            print("child alive after the notice", flush=True)
            child.kill()  # type: ignore[union-attr]
        sys.exit(143)

    signal.signal(signal.SIGTERM, check_child)
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])

from vertexrt.distributed import cluster  # noqa: E402

me = cluster()
name = me.role if me.role == "chief" else f"{me.role}-{me.task_index}"
shared = Path(os.environ["AIP_CHECKPOINT_DIR"])
shared.mkdir(parents=True, exist_ok=True)


def ignore_sigterm_and_sleep() -> None:
    signal.signal(signal.SIGTERM, lambda *_: print("ignoring SIGTERM", flush=True))
    (shared / f"{name}.ready").touch()
    time.sleep(60)


def wait_for_workers() -> None:
    """Until every worker ignores SIGTERM (so the teardown has to escalate)."""
    deadline = time.monotonic() + 60
    while len(list(shared.glob("worker-*.ready"))) < me.num_nodes - 1 and time.monotonic() < deadline:
        time.sleep(0.05)


if mode == "env":
    keys = [
        "CLUSTER_SPEC",
        "TF_CONFIG",
        "MASTER_ADDR",
        "MASTER_PORT",
        "WORLD_SIZE",
        "RANK",
        "LOCAL_RANK",
        "AIP_MODEL_DIR",
        "AIP_CHECKPOINT_DIR",
        "AIP_TENSORBOARD_LOG_DIR",
        "CLOUD_ML_JOB_ID",
        "CLOUD_ML_PROJECT_ID",
        "CLOUD_ML_REGION",
        "CLOUD_ML_TRIAL_ID",
    ]
    record = {k: os.environ.get(k) for k in keys}
    record["cluster"] = {"rank": me.rank, "world_size": me.world_size, "role": me.role, "trial": me.trial_id}
    print("RESULT " + json.dumps(record), flush=True)
elif mode in ("fail_chief", "chief_done"):
    if me.role != "chief":
        ignore_sigterm_and_sleep()
    wait_for_workers()
    sys.exit(int(sys.argv[2]) if mode == "fail_chief" else 0)
elif mode == "fail_worker":
    if me.role == "worker":
        sys.exit(int(sys.argv[2]))
    time.sleep(60)
elif mode == "preempt":
    attempts = shared / f"{name}.attempts"
    with attempts.open("a") as f:
        f.write("x")
    count = len(attempts.read_text())
    if count == 1:
        print("waiting to be preempted", flush=True)
        time.sleep(60)
    print("RESULT " + json.dumps({"attempt": count}), flush=True)
elif mode == "finish_on_notice":
    attempts = shared / f"{name}.attempts"
    with attempts.open("a") as f:
        f.write("x")
    if len(attempts.read_text()) == 1:
        print("waiting for the notice", flush=True)
        time.sleep(60)
    print("RESULT " + json.dumps({"attempt": len(attempts.read_text())}), flush=True)
elif mode == "notice_with_child":
    print("waiting to be preempted", flush=True)
    time.sleep(60)
elif mode == "sleep":
    print("sleeping", flush=True)
    time.sleep(60)
else:
    sys.exit(f"unknown mode {mode}")

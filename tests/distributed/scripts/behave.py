"""A replica that behaves as told, to test local-run without a framework: ``behave.py MODE [ARG]``."""

import json
import os
import signal
import sys
import time
from pathlib import Path

from vertexrt.distributed import cluster

mode = sys.argv[1]
me = cluster()
name = me.role if me.role == "chief" else f"{me.role}-{me.task_index}"


def ignore_sigterm() -> None:
    signal.signal(signal.SIGTERM, lambda *_: print("ignoring SIGTERM", flush=True))


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
elif mode == "fail_chief":
    if me.role == "chief":
        time.sleep(0.5)
        sys.exit(int(sys.argv[2]))
    ignore_sigterm()
    time.sleep(60)
elif mode == "fail_worker":
    if me.role == "worker":
        time.sleep(0.3)
        sys.exit(int(sys.argv[2]))
    time.sleep(60)
elif mode == "chief_done":
    if me.role != "chief":
        ignore_sigterm()
        time.sleep(60)
elif mode == "preempt":
    attempts = Path(os.environ["AIP_CHECKPOINT_DIR"]) / f"{name}.attempts"
    attempts.parent.mkdir(parents=True, exist_ok=True)
    with attempts.open("a") as f:
        f.write("x")
    count = len(attempts.read_text())
    if count == 1:
        signal.signal(signal.SIGTERM, lambda *_: (print("got SIGTERM, saving", flush=True), sys.exit(143)))
        time.sleep(60)
    print("RESULT " + json.dumps({"attempt": count}), flush=True)
elif mode == "sleep":
    time.sleep(60)
else:
    sys.exit(f"unknown mode {mode}")

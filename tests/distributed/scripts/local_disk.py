"""A replica with a local disk, for local-run's lost VMs: ``local_disk.py``.

Each start prints ``RESULT {"attempt", "disk", "files"}``: what its local disk
(``$VERTEXRT_LOCAL_CHECKPOINT_DIR``) holds; then it leaves a file ``attempt-N`` there. On its first attempt
it waits for every replica to get there, then steps, reporting each step to ``vertexrt.audit`` (where a
chaos fault lands), until it is stopped (60 s at most, then exit 1); on a later attempt it exits 0.
"""

import json
import os
import sys
import time
from pathlib import Path

from vertexrt import audit

task = json.loads(os.environ["CLUSTER_SPEC"])["task"]
label = f"{task['type']}-{task['index']}"
counter = Path(os.environ["AIP_CHECKPOINT_DIR"]) / f"{label}.attempts"
counter.parent.mkdir(parents=True, exist_ok=True)
attempt = int(counter.read_text()) + 1 if counter.exists() else 1
counter.write_text(str(attempt))
disk = Path(os.environ["VERTEXRT_LOCAL_CHECKPOINT_DIR"])
files = sorted(p.name for p in disk.iterdir())
print("RESULT " + json.dumps({"attempt": attempt, "disk": str(disk), "files": files}), flush=True)
(disk / f"attempt-{attempt}").write_text(label)
if attempt == 1:  # step once every replica has written to its disk: a fault then finds all of them there
    spec = json.loads(os.environ["CLUSTER_SPEC"])["cluster"]
    replicas = len(spec.get("workerpool0", [])) + len(spec.get("workerpool1", []))
    ready = counter.parent / "ready"
    ready.mkdir(exist_ok=True)
    (ready / label).touch()
    deadline = time.monotonic() + 60
    while len(list(ready.iterdir())) < replicas and time.monotonic() < deadline:
        time.sleep(0.02)
    print("ready", flush=True)
    step = 0
    while time.monotonic() < deadline:
        step += 1
        audit.step(step)
        time.sleep(0.05)
    sys.exit(1)

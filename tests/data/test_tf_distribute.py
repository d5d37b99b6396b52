"""``as_tf()`` under a real two-worker ``MultiWorkerMirroredStrategy``: every record of a worker's share
reaches its replica (tf.distribute must not shard the already-sharded stream again)."""

from __future__ import annotations

import json
import os
import sys
from contextlib import ExitStack
from pathlib import Path

import pytest
from jobs import start_job

from vertexrt._net import free_ports

pytest.importorskip("tensorflow")

WORKER = Path(__file__).resolve().parent / "scripts" / "as_tf_worker.py"


@pytest.mark.slow
def test_every_record_of_a_workers_share_reaches_its_replica(tmp_path, id_files) -> None:
    id_files(str(tmp_path), [150, 250])  # 400 records: 200 per worker
    ports = free_ports(2)
    cluster = {"worker": [f"127.0.0.1:{p}" for p in ports]}
    with ExitStack() as running:
        workers = []
        for index in range(2):
            tf_config = json.dumps({"cluster": cluster, "task": {"type": "worker", "index": index}})
            command = [sys.executable, str(WORKER), f"{tmp_path}/part-*.jsonl", str(index)]
            workers.append(
                running.enter_context(start_job(command, env={**os.environ, "TF_CONFIG": tf_config}))
            )
        results = []
        for job in workers:
            done = job.wait(180)
            assert done.returncode == 0, done.stdout[-3000:]
            results.append(json.loads(done.stdout.partition("RESULT ")[2].splitlines()[0]))
    ids = [r["ids"] for r in results]
    assert [len(i) for i in ids] == [200, 200]
    assert sorted(ids[0] + ids[1]) == list(range(400))
    assert [r["cardinality"] for r in results] == [200, 200]  # known: Keras needs no steps_per_epoch

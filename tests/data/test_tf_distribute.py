"""``as_tf()`` under a real two-worker ``MultiWorkerMirroredStrategy``: every record of a worker's share
reaches its replica (tf.distribute must not shard the already-sharded stream again)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from vertexrt._net import free_ports

pytest.importorskip("tensorflow")

_WORKER = r"""
import json, os, sys
os.environ["TF_CPP_MIN_LOG_LEVEL"] = "2"
import tensorflow as tf
from vertexrt.data import open_dataset

index = int(sys.argv[2])
strategy = tf.distribute.MultiWorkerMirroredStrategy()
ds = open_dataset(sys.argv[1], seed=3, rank=index, world_size=2)
tf_ds = ds.as_tf()
seen = []
for batch in strategy.experimental_distribute_dataset(tf_ds.batch(8)):
    for part in strategy.experimental_local_results(batch):
        seen.extend(int(i) for i in part["id"].numpy())
print("RESULT " + json.dumps({"ids": seen, "cardinality": int(tf_ds.cardinality())}), flush=True)
"""


@pytest.mark.slow
def test_every_record_of_a_workers_share_reaches_its_replica(tmp_path, id_files) -> None:
    id_files(str(tmp_path), [150, 250])  # 400 records: 200 per worker
    ports = free_ports(2)
    cluster = {"worker": [f"127.0.0.1:{p}" for p in ports]}
    procs = []
    for index in range(2):
        env = {
            **os.environ,
            "TF_CONFIG": json.dumps({"cluster": cluster, "task": {"type": "worker", "index": index}}),
        }
        procs.append(
            subprocess.Popen(
                [sys.executable, "-c", _WORKER, f"{tmp_path}/part-*.jsonl", str(index)],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    results = []
    try:
        for proc in procs:
            out, _ = proc.communicate(timeout=180)
            assert proc.returncode == 0, out[-3000:]
            results.append(json.loads(out.partition("RESULT ")[2].splitlines()[0]))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    ids = [r["ids"] for r in results]
    assert [len(i) for i in ids] == [200, 200]
    assert sorted(ids[0] + ids[1]) == list(range(400))
    assert [r["cardinality"] for r in results] == [200, 200]  # known: Keras needs no steps_per_epoch

"""One worker of a two-worker MultiWorkerMirroredStrategy (``TF_CONFIG``) reading its share through
``as_tf()``: ``as_tf_worker.py GLOB INDEX`` prints ``RESULT {"ids": [...], "cardinality": N}``."""

import json
import os
import sys

os.environ["TF_CPP_MIN_LOG_LEVEL"] = "2"
import tensorflow as tf  # noqa: E402

from vertexrt.data import open_dataset  # noqa: E402

index = int(sys.argv[2])
strategy = tf.distribute.MultiWorkerMirroredStrategy()
ds = open_dataset(sys.argv[1], seed=3, rank=index, world_size=2)
tf_ds = ds.as_tf()
seen = []
for batch in strategy.experimental_distribute_dataset(tf_ds.batch(8)):
    for part in strategy.experimental_local_results(batch):
        seen.extend(int(i) for i in part["id"].numpy())
print("RESULT " + json.dumps({"ids": seen, "cardinality": int(tf_ds.cardinality())}), flush=True)

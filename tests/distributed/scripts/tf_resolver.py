"""Read each TF_CONFIG given on stdin (a JSON list) back through TensorFlow's own TFConfigClusterResolver."""

import json
import os
import sys

import tensorflow as tf

out = []
for config in json.load(sys.stdin):
    os.environ["TF_CONFIG"] = json.dumps(config)
    resolver = tf.distribute.cluster_resolver.TFConfigClusterResolver()
    out.append(
        {"cluster": resolver.cluster_spec().as_dict(), "type": resolver.task_type, "index": resolver.task_id}
    )
print("RESULT " + json.dumps(out))

"""Quickstart: what a Vertex job sees, and writing through the path layer.

Simulates a Vertex AI custom job on this machine (unless it already runs in one): a local directory stands
in for Cloud Storage as the /gcs/ FUSE mount. Prints the resolved environment, then writes a file to the
job's model directory through ``vertexrt.paths`` and reads it back through the ``gs://`` form of its name.

Run: python examples/quickstart.py

It trains nothing, so the seeded fault certificate (``vertexrt local-run --chaos``) has no step to fault here;
the training examples are certified by tests/test_certify.py.
"""

from __future__ import annotations

import json
import os

import vertexrt
from vertexrt import paths


def simulate_vertex_job(bucket_root: str) -> None:
    """The variables Vertex would set for a 1-replica job with baseOutputDirectory gs://demo-bucket/run."""
    os.makedirs(os.path.join(bucket_root, "demo-bucket"), exist_ok=True)
    os.environ["VERTEXRT_FUSE_ROOT"] = bucket_root  # /gcs/demo-bucket/... lives here
    os.environ["VERTEXRT_PREFER_FUSE"] = "1"  # and gs://demo-bucket/... goes through that "mount"
    os.environ.update(
        CLOUD_ML_PROJECT_ID="123456789012",
        CLOUD_ML_REGION="us-central1",
        CLOUD_ML_JOB_ID="4242",
        AIP_MODEL_DIR="gs://demo-bucket/run/model/",
        AIP_CHECKPOINT_DIR="gs://demo-bucket/run/checkpoints/",
        AIP_TENSORBOARD_LOG_DIR="gs://demo-bucket/run/logs/",
        CLUSTER_SPEC=json.dumps(
            {
                "cluster": {"workerpool0": ["cmle-training-workerpool0-0123456789-0:2222"]},
                "environment": "cloud",
                "task": {"type": "workerpool0", "index": 0},
            }
        ),
    )


def main() -> None:
    if not os.environ.get("CLOUD_ML_JOB_ID"):
        simulate_vertex_job(os.path.abspath("vertexrt_output/gcs"))
    env = vertexrt.environment()
    print(f"on Vertex: {env.on_vertex}  project: {vertexrt.project_id()}  region: {env.region}")
    print(f"job: {env.job_id}  trial: {env.trial_id}")
    for name in ("model_dir", "checkpoint_dir", "tensorboard_log_dir"):
        print(f"{name:>20}: {getattr(env, name)}  (FUSE: {paths.to_fuse(getattr(env, name))})")

    target = paths.join(env.model_dir, "hello.json")
    with paths.open(target, "w") as handle:
        handle.write(json.dumps({"written_by": "vertexrt quickstart", "job": env.job_id}))
    with paths.open(paths.to_fuse(target)) as handle:
        print(f"wrote {target} and read it back via {paths.to_fuse(target)}: {handle.read().decode()}")


if __name__ == "__main__":
    main()

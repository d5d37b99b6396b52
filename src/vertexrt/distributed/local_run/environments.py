"""The environment Vertex gives each replica of a simulated job (``CLUSTER_SPEC``, ``TF_CONFIG``,
``MASTER_*``, ``AIP_*``, ``CLOUD_ML_*``) and the job's shape."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from vertexrt import env as contract
from vertexrt.distributed.detection import cluster
from vertexrt.distributed.torch import child_environment

#: A replica inherits no platform variable (:func:`vertexrt.env.is_platform_variable`) from the launching
#: shell: the launcher sets them. The managed-dataset ones come from ``--training-data``... or, when the user
#: set them in the shell, from there, said on a line of its own.
DATA_VARIABLES = {
    "training_data": "AIP_TRAINING_DATA_URI",
    "validation_data": "AIP_VALIDATION_DATA_URI",
    "test_data": "AIP_TEST_DATA_URI",
    "data_format": "AIP_DATA_FORMAT",
}


#: Vertex pool -> its TF_CONFIG task type.
_TF_TYPES = {"workerpool0": "chief", "workerpool1": "worker", "workerpool2": "ps", "workerpool3": "evaluator"}


def with_this_python(command: Sequence[str]) -> list[str]:
    """``command`` with a bare ``python``/``python3`` replaced by this interpreter (``sys.executable``), so
    the replicas run in the environment ``vertexrt`` was started from, not whatever is first on ``PATH``."""
    if command and command[0] in ("python", "python3"):
        return [sys.executable, *command[1:]]
    return list(command)


@dataclass(frozen=True)
class JobSpec:
    """What to run and the shape of the simulated Vertex job."""

    command: list[str]
    workers: int = 1
    ps: int = 0
    reduction_servers: int = 0
    evaluators: int = 0
    processes_per_node: int = 1
    trial: str | None = None
    job_id: str = "local"
    project: str = "local-project"
    region: str = "us-central1"
    base_output_dir: str | None = None
    data: Mapping[str, str] = field(default_factory=dict)  # AIP_*_DATA_URI, AIP_DATA_FORMAT
    stagger: float = 0.0


@dataclass(frozen=True)
class Replica:
    """One process to start: its label (the Vertex replica name, ``workerpool1-0``, and ``/<local rank>``
    with several processes per replica), pool, and full environment."""

    label: str
    pool: str
    index: int
    env: dict[str, str]
    runs: bool = True

    @property
    def on_chief_replica(self) -> bool:
        """On workerpool0-0, the replica that judges the job (with several processes per replica, every
        one of them is here; the chief *process* is only rank 0)."""
        return self.pool == "workerpool0"


def replica_environments(job: JobSpec, base_env: Mapping[str, str], ports: Sequence[int]) -> list[Replica]:
    """Every process of ``job`` with the environment Vertex would give it; ``ports`` supplies one free port
    per replica plus one for ``MASTER_PORT``."""
    sizes = {
        "workerpool0": 1,
        "workerpool1": job.workers - 1,
        "workerpool2": job.ps or job.reduction_servers,
        "workerpool3": job.evaluators,
    }
    free = iter(ports)
    pools = {name: [f"127.0.0.1:{next(free)}" for _ in range(n)] for name, n in sizes.items() if n}
    master_port = next(free)
    multi = sum(sizes.values()) > 1
    tf_cluster = {
        _TF_TYPES[n]: a
        for n, a in pools.items()
        if n != "workerpool3" and not (n == "workerpool2" and job.reduction_servers)
    }
    common = {k: v for k, v in base_env.items() if not contract.is_platform_variable(k)}
    common.update(_job_variables(job))
    common.update(job.data)
    if "CLOUD_ML_HP_METRIC_FILE" not in base_env:  # each job and trial its own, not one shared default
        common["CLOUD_ML_HP_METRIC_FILE"] = _metric_file(job)
    common.setdefault("PYTHONUNBUFFERED", "1")
    common["VERTEXRT_LOCAL_RUN"] = "1"
    job_field = {"python_module": "", "package_uris": [], "job_args": job.command[1:]}
    replicas = []
    for pool, addresses in pools.items():
        for index in range(len(addresses)):
            env = dict(common)
            task = {"type": pool, "index": index, "trial": job.trial or ""}
            env["CLUSTER_SPEC"] = json.dumps(
                {"cluster": pools, "environment": "cloud", "task": task, "job": job_field}
            )
            node_rank = {"workerpool0": 0, "workerpool1": 1 + index}.get(pool)
            if multi:
                tf_task = {
                    "type": _TF_TYPES[pool],
                    "index": index,
                    **({"trial": job.trial} if job.trial else {}),
                }
                env["TF_CONFIG"] = json.dumps(
                    {"cluster": tf_cluster, "environment": "cloud", "task": tf_task, "job": job_field}
                )
                env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(master_port), WORLD_SIZE=str(job.workers))
                if node_rank is not None:
                    env["RANK"] = str(node_rank)
            label = f"{pool}-{index}"
            if pool == "workerpool2" and job.reduction_servers:
                replicas.append(Replica(label=label, pool=pool, index=index, env=env, runs=False))
            elif node_rank is not None and job.processes_per_node > 1:
                node = cluster(env)
                for local in range(job.processes_per_node):
                    local_env = dict(env)
                    local_env.update(
                        child_environment(node, local, job.processes_per_node, f"127.0.0.1:{master_port}")
                    )
                    replicas.append(Replica(label=f"{label}/{local}", pool=pool, index=index, env=local_env))
            else:
                replicas.append(Replica(label=label, pool=pool, index=index, env=env))
    return replicas


def port_count(job: JobSpec) -> int:
    """Ports :func:`replica_environments` needs: one per replica and ``MASTER_PORT``."""
    return job.workers + max(job.ps, job.reduction_servers) + job.evaluators + 1


def _base_dir(job: JobSpec, local: bool = False) -> str:
    """The job's (trial-scoped) output directory, ``/``-terminated; ``local``: on this machine even when
    ``--base-output-dir`` is a ``gs://`` URI."""
    base = job.base_output_dir or os.path.join("vertexrt_output", job.job_id)
    if local and "://" in base:
        base = os.path.join("vertexrt_output", job.job_id)
    if "://" not in base:
        base = str(Path(base).absolute())
    return base.rstrip("/") + "/" + (f"{job.trial}/" if job.trial else "")


def _metric_file(job: JobSpec) -> str:
    """Where this job's (trial's) hypertune reports go: under its local output directory."""
    return _base_dir(job, local=True) + "hypertune/output.metrics"


def _job_variables(job: JobSpec) -> dict[str, str]:
    base = _base_dir(job)
    variables = {
        "CLOUD_ML_JOB_ID": job.job_id,
        "CLOUD_ML_PROJECT_ID": job.project,
        "CLOUD_ML_REGION": job.region,
        "AIP_MODEL_DIR": base + "model/",
        "AIP_CHECKPOINT_DIR": base + "checkpoints/",
        "AIP_TENSORBOARD_LOG_DIR": base + "logs/",
    }
    if job.trial:
        variables["CLOUD_ML_TRIAL_ID"] = job.trial
    return variables

"""tf_config() and setup_tensorflow(): what TensorFlow reads back, real multi-worker training, the Keras
finding, the ordering error, and a worker whose peer never comes."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from types import SimpleNamespace

import pytest
from jobs import run_tree

from vertexrt.distributed import Cluster, cluster, tf_config
from vertexrt.distributed.tensorflow import KERAS_ADVICE, _choose, _extra_keys, _steer_keras, keras_flavour
from vertexrt.errors import ClusterSpecError, ConfigError

from .conftest import SCRIPTS

POOLS = {
    "workerpool0": ["cmle-training-workerpool0-ab-0:2222"],
    "workerpool1": ["cmle-training-workerpool1-ab-0:2222", "cmle-training-workerpool1-ab-1:2222"],
    "workerpool2": ["cmle-training-workerpool2-ab-0:2222"],
    "workerpool3": ["cmle-training-workerpool3-ab-0:2222"],
}


TF_WORKER = json.dumps(
    {"cluster": {"chief": ["c:1"], "worker": ["w:1"]}, "task": {"type": "worker", "index": 0}}
)


def vertex(pools: dict[str, list[str]], task: str, index: int = 0, trial: str = "") -> Cluster:
    return cluster(
        {
            "CLUSTER_SPEC": json.dumps(
                {"cluster": pools, "task": {"type": task, "index": index, "trial": trial}}
            )
        }
    )


def test_tf_config_maps_vertex_pools_to_tensorflow_task_types() -> None:
    config = tf_config(vertex(POOLS, "workerpool1", 1, trial="2"))
    assert config == {
        "cluster": {
            "chief": POOLS["workerpool0"],
            "worker": POOLS["workerpool1"],
            "ps": POOLS["workerpool2"],
        },
        "task": {"type": "worker", "index": 1, "trial": "2"},
    }
    evaluator = tf_config(vertex(POOLS, "workerpool3"))
    assert evaluator["task"] == {"type": "evaluator", "index": 0} and "evaluator" not in evaluator["cluster"]
    assert tf_config(vertex(POOLS, "workerpool2"))["task"] == {"type": "ps", "index": 0}


def test_tf_config_of_a_cluster_from_a_mapping_takes_nothing_from_os_environ(monkeypatch) -> None:
    monkeypatch.setenv("TF_CONFIG", json.dumps({**json.loads(TF_WORKER), "rpc_layer": "process-wide"}))
    mapping = {"TF_CONFIG": json.dumps({**json.loads(TF_WORKER), "session_master": "grpc://c:1"})}
    built = cluster(mapping)
    assert "rpc_layer" not in tf_config(built) and "session_master" not in tf_config(built)
    for config in (tf_config(environ=mapping), tf_config(built, environ=mapping)):
        assert config["session_master"] == "grpc://c:1" and "rpc_layer" not in config
    assert tf_config()["rpc_layer"] == "process-wide"  # read from the process environment: its keys


def test_tf_config_is_empty_without_a_cluster() -> None:
    assert tf_config(Cluster(source="local")) == {}
    assert tf_config(vertex({"workerpool0": POOLS["workerpool0"]}, "workerpool0")) == {}


def test_tf_config_refuses_what_it_cannot_describe() -> None:
    master_only = cluster({"MASTER_ADDR": "h", "RANK": "0", "WORLD_SIZE": "2"})
    with pytest.raises(ClusterSpecError, match="MASTER_ADDR, which does not list every replica"):
        tf_config(master_only)
    reducer = cluster(
        {
            "CLUSTER_SPEC": json.dumps({"cluster": POOLS, "task": {"type": "workerpool2", "index": 0}}),
            "VERTEXRT_WORKERPOOL2": "reduction_server",
        }
    )
    with pytest.raises(ConfigError, match="Reduction Server"):
        tf_config(reducer)


def test_rewriting_tf_config_keeps_what_it_does_not_own() -> None:
    existing = json.dumps({"cluster": {}, "task": {}, "rpc_layer": "grpc", "environment": "cloud"})
    assert _extra_keys(existing) == {"rpc_layer": "grpc", "environment": "cloud"}
    assert _extra_keys("not json") == _extra_keys("[1]") == _extra_keys(None) == {}


class FakeTF:
    """Just what strategy choice and Keras steering look at: ``tf.config`` GPUs and ``tf.keras``."""

    __version__ = "2.21.0"

    def __init__(self, gpus: int = 0, keras: object = None) -> None:
        self.config = SimpleNamespace(list_physical_devices=lambda kind: ["gpu"] * gpus)
        if keras is not None:
            self.keras = keras


def test_auto_strategy_follows_the_cluster() -> None:
    workers = vertex(
        {"workerpool0": POOLS["workerpool0"], "workerpool1": POOLS["workerpool1"]}, "workerpool1"
    )
    with_ps = vertex(POOLS, "workerpool0")
    single = Cluster(source="local")
    assert _choose("auto", workers, tf_config(workers), FakeTF()) == "multi_worker_mirrored"
    assert _choose("auto", with_ps, tf_config(with_ps), FakeTF()) == "parameter_server"
    assert _choose("auto", vertex(POOLS, "workerpool3"), {}, FakeTF()) == "default"
    assert _choose("auto", single, {}, FakeTF(gpus=2)) == "mirrored"
    assert _choose("auto", single, {}, FakeTF(gpus=1)) == "default"
    assert _choose("mirrored", workers, tf_config(workers), FakeTF()) == "mirrored"


def test_keras_steering(monkeypatch, caplog) -> None:
    unresolved = SimpleNamespace(_tfll_initialized=False)
    keras_3 = SimpleNamespace(__name__="keras._tf_keras.keras")
    legacy = SimpleNamespace(__name__="tf_keras.api._v2.keras")
    assert keras_flavour(FakeTF(keras=unresolved)) == "unresolved"
    assert keras_flavour(FakeTF(keras=keras_3)) == "keras_3"
    assert keras_flavour(FakeTF(keras=legacy)) == "tf_keras"
    monkeypatch.setenv("TF_USE_LEGACY_KERAS", "")  # not requested; restored after the test
    with caplog.at_level("WARNING", logger="vertexrt.distributed.tensorflow"):
        _steer_keras(FakeTF(keras=unresolved), "multi_worker_mirrored", None)
        _steer_keras(FakeTF(keras=keras_3), "default", None)  # not multi-worker: nothing to say
        _steer_keras(FakeTF(keras=keras_3), "multi_worker_mirrored", False)  # the user chose Keras 3
    assert [r.getMessage() for r in caplog.records] == [KERAS_ADVICE]
    with pytest.raises(ConfigError, match="already used and resolved to Keras 3"):
        _steer_keras(FakeTF(keras=keras_3), "multi_worker_mirrored", True)
    _steer_keras(FakeTF(keras=unresolved), "multi_worker_mirrored", True)
    assert os.environ["TF_USE_LEGACY_KERAS"] == "1"
    monkeypatch.setattr("importlib.util.find_spec", lambda name: None)
    with pytest.raises(ConfigError, match=r"pip install --no-deps tf-keras==2.21.0"):
        _steer_keras(FakeTF(keras=unresolved), "multi_worker_mirrored", True)


def test_setup_tensorflow_rejects_bad_requests_before_importing_tensorflow() -> None:
    probe = (
        "import sys\n"
        "from vertexrt.distributed import Cluster, setup_tensorflow\n"
        "from vertexrt.errors import ConfigError\n"
        "for args in (('mirrored_multi',), ('multi_worker_mirrored',)):\n"
        "    try:\n"
        "        setup_tensorflow(*args, cluster=Cluster(source='local'))\n"
        "    except ConfigError as err:\n"
        "        print(err)\n"
        "print('tensorflow' in sys.modules)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, check=True
    )
    lines = out.stdout.splitlines()
    assert "expected one of auto" in lines[0]
    assert "needs a multi-replica cluster" in lines[1]
    assert lines[2] == "False"  # rejected before TensorFlow was imported


@pytest.mark.slow
def test_tensorflow_reads_back_what_tf_config_writes(tmp_path) -> None:
    clusters = [vertex(POOLS, pool, i) for pool in POOLS for i in range(len(POOLS[pool]))]
    clusters.append(
        cluster(
            {
                "TF_CONFIG": json.dumps(
                    {
                        "cluster": {"master": ["m:1"], "worker": ["w:1"]},
                        "task": {"type": "master", "index": 0},
                    }
                )
            }
        )
    )
    configs = [tf_config(c) for c in clusters]
    proc = subprocess.run(
        [sys.executable, str(SCRIPTS / "tf_resolver.py")],
        input=json.dumps(configs),
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    read_back = json.loads(proc.stdout.partition("RESULT ")[2])
    for config, seen in zip(configs, read_back, strict=True):
        assert seen["cluster"] == config["cluster"]
        assert (seen["type"], seen["index"]) == (config["task"]["type"], config["task"]["index"])


@pytest.mark.slow
def test_two_workers_train_a_step_with_identical_weights(local_run) -> None:
    run = local_run("--workers", "2", "--", "tf_train.py", "ctl", timeout=180)
    assert run.returncode == 0, run.output
    chief, worker = run.results()["workerpool0-0"], run.results()["workerpool1-0"]
    assert chief["is_multi_worker"] and chief["replicas"] == 2
    assert chief["weights"] == worker["weights"]
    assert run.output.count("Keras 3 (the tf.keras of TensorFlow >= 2.16) fails in model.fit") == 2


@pytest.mark.slow
def test_keras_fit_works_with_legacy_keras(local_run) -> None:
    run = local_run("--workers", "2", "--", "tf_train.py", "fit_legacy", timeout=180)
    assert run.returncode == 0, run.output
    chief, worker = run.results()["workerpool0-0"], run.results()["workerpool1-0"]
    assert chief["keras"].startswith("tf_keras") and chief["is_multi_worker"]
    assert chief["weights"] == worker["weights"]
    assert "Keras 3 (the tf.keras" not in run.output


@pytest.mark.slow
def test_parameter_server_job_coordinates_from_the_chief(local_run) -> None:
    run = local_run("--workers", "2", "--ps", "1", "--", "tf_train.py", "ps", timeout=180)
    assert run.returncode == 0, run.output
    assert list(run.results()) == ["workerpool0-0"]  # the worker and the ps serve until they are shut down
    result = run.results()["workerpool0-0"]
    assert result["strategy"].startswith("ParameterServerStrategy") and result["value"] == 4.0


@pytest.mark.slow
def test_setup_after_tensorflow_ran_ops_explains_the_ordering_and_keras(tmp_path) -> None:
    tf_config_value = json.dumps(
        {"cluster": {"worker": ["127.0.0.1:1", "127.0.0.1:2"]}, "task": {"type": "worker", "index": 0}}
    )
    run = run_tree(
        [sys.executable, str(SCRIPTS / "tf_train.py"), "after_ops"],
        timeout=120,
        cwd=tmp_path,
        env={"TF_CONFIG": tf_config_value},
    )
    assert run.returncode == 0, run.output
    (record,) = run.records()
    assert "must run before TensorFlow executes its first op" in record["error"]
    assert "tf.keras was already used and resolved to Keras 3" in record["keras_error"]
    assert record["default"] == "_DefaultDistributionStrategy"  # a single process needs no setup order
    assert record["gpus"] == [0, 0]


@pytest.mark.slow
def test_worker_whose_peer_never_starts_is_killed(local_run) -> None:
    run = local_run(
        "--workers",
        "2",
        "--grace",
        "2",
        "--",
        "tf_train.py",
        "hang_chief",
        timeout=120,
        stop_when="entering the strategy constructor",
        stop_delay=3,
    )
    assert run.returncode == 128 + 15, run.output  # the launcher was stopped with SIGTERM
    assert "workerpool0-0 ignored SIGTERM: SIGKILLed after the 2 s grace" in run.output


@pytest.mark.slow
def test_a_chief_whose_worker_never_starts_exits_at_the_rendezvous_deadline(local_run) -> None:
    # The chief used to wait in the strategy constructor for good (holding the GIL: no Python timer runs).
    run = local_run(
        "--workers",
        "2",
        "--",
        "tf_train.py",
        "hang_chief",
        timeout=120,
        env={"VERTEXRT_RENDEZVOUS_TIMEOUT": "5"},
    )
    assert run.returncode == 1, run.output
    assert "waiting for the cluster's 2 tasks, at most 5 s (VERTEXRT_RENDEZVOUS_TIMEOUT)" in run.output
    assert re.search(r"Timeout \(0:00:0[45]\.?\d*\)!", run.output), run.output  # a stack dump follows


RESOLVE = """
import json, os, sys
import tensorflow as tf
out = []
for config in json.load(sys.stdin):
    os.environ["TF_CONFIG"] = json.dumps(config)
    r = tf.distribute.cluster_resolver.TFConfigClusterResolver()
    out.append([r.rpc_layer, r.master(), r.task_type, r.task_id, r.cluster_spec().as_dict()])
print("RESULT " + json.dumps(out))
"""


@pytest.mark.slow
def test_tf_config_keeps_rpc_layer_and_session_master(monkeypatch, tmp_path) -> None:
    pytest.importorskip("tensorflow")
    original = {
        "cluster": {"chief": ["c:1"], "worker": ["w:1", "w:2"]},
        "task": {"type": "worker", "index": 1},
        "rpc_layer": "grpc+verbs",
        "session_master": "grpc://c:1",
        "environment": "cloud",
    }
    monkeypatch.setenv("TF_CONFIG", json.dumps(original))
    ours = tf_config()
    assert (ours["rpc_layer"], ours["session_master"]) == ("grpc+verbs", "grpc://c:1")
    proc = subprocess.run(
        [sys.executable, "-c", RESOLVE],
        input=json.dumps([original, ours]),
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    theirs, mine = json.loads(proc.stdout.partition("RESULT ")[2])
    assert mine == theirs and theirs[:2] == ["grpc+verbs", "grpc://c:1"]

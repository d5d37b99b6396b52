"""cluster(): every source, the documented Vertex examples, the detection order, and bad input."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings

import pytest

from vertexrt.distributed import Cluster, ClusterSpecWarning, cluster, world_info
from vertexrt.errors import ClusterSpecError

WP0 = "cmle-training-workerpool0-ab12cd34ef-0:2222"
WP1 = [f"cmle-training-workerpool1-ab12cd34ef-{i}:2222" for i in range(2)]
WP2 = [f"cmle-training-workerpool2-ab12cd34ef-{i}:2222" for i in range(2)]
WP3 = ["cmle-training-workerpool3-ab12cd34ef-0:2222"]


def spec(pools: dict[str, list[str]], task: str, index: int = 0, trial: str = "") -> str:
    return json.dumps(
        {"cluster": pools, "environment": "cloud", "task": {"type": task, "index": index, "trial": trial}}
    )


def tf(pools: dict[str, list[str]], task: str, index: int = 0, **extra: object) -> str:
    return json.dumps({"cluster": pools, "task": {"type": task, "index": index, **extra}})


def test_no_variable_is_a_single_local_process() -> None:
    c = cluster({})
    assert (c.source, c.rank, c.world_size, c.local_rank, c.local_world_size) == ("local", 0, 1, 0, 1)
    assert c.is_chief and c.in_training_world and not c.is_distributed
    assert c.chief_address is None and c.trial_id is None
    assert cluster({"CLOUD_ML_TRIAL_ID": "5"}).trial_id == "5"


def test_single_replica_vertex_job_has_only_cluster_spec() -> None:
    c = cluster({"CLUSTER_SPEC": spec({"workerpool0": [WP0]}, "workerpool0")})
    assert (c.source, c.role, c.rank, c.world_size, c.num_nodes) == ("CLUSTER_SPEC", "chief", 0, 1, 1)
    assert c.chief_address == WP0 and c.rendezvous_address == WP0
    assert c.pool("chief") is not None and c.pool("chief").name == "workerpool0"  # type: ignore[union-attr]


@pytest.mark.parametrize(
    ("task", "rank"), [(("workerpool0", 0), 0), (("workerpool1", 0), 1), (("workerpool1", 1), 2)]
)
def test_chief_and_workers_count_nodes(vertex_env, task: tuple[str, int], rank: int) -> None:
    vertex_env(workers=2, task=task)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # CLUSTER_SPEC, TF_CONFIG and RANK agree
        c = cluster()
    assert (c.source, c.rank, c.world_size, c.node_rank, c.num_nodes) == ("CLUSTER_SPEC", rank, 3, rank, 3)
    assert c.is_chief == (rank == 0)
    assert c.role == ("chief" if rank == 0 else "worker") and c.task_index == task[1]
    assert c.chief_address == WP0
    assert c.rendezvous_address == "cmle-training-workerpool0-ab12cd34ef-0:2222"  # MASTER_ADDR:MASTER_PORT


def test_parameter_servers_are_outside_the_training_world() -> None:
    pools = {"workerpool0": [WP0], "workerpool1": WP1, "workerpool2": WP2}
    tf_pools = {"chief": [WP0], "worker": WP1, "ps": WP2}
    ps = cluster({"CLUSTER_SPEC": spec(pools, "workerpool2", 1), "TF_CONFIG": tf(tf_pools, "ps", 1)})
    assert (ps.role, ps.task_index, ps.rank, ps.node_rank, ps.world_size) == ("ps", 1, -1, -1, 3)
    assert not ps.is_chief and not ps.in_training_world
    worker = cluster({"CLUSTER_SPEC": spec(pools, "workerpool1", 1), "TF_CONFIG": tf(tf_pools, "worker", 1)})
    assert (worker.rank, worker.world_size) == (2, 3)


def test_reduction_server_pool_is_recognised_and_excluded() -> None:
    pools = {"workerpool0": [WP0], "workerpool1": WP1, "workerpool2": WP2}
    tf_pools = {"chief": [WP0], "worker": WP1}  # TF_CONFIG lists no ps: workerpool2 is a Reduction Server
    c = cluster({"CLUSTER_SPEC": spec(pools, "workerpool1", 0), "TF_CONFIG": tf(tf_pools, "worker", 0)})
    assert c.pool("reduction_server") is not None and c.pool("ps") is None
    assert (c.rank, c.world_size) == (1, 3)
    forced = cluster({"CLUSTER_SPEC": spec(pools, "workerpool0"), "VERTEXRT_WORKERPOOL2": "reduction_server"})
    assert forced.pool("reduction_server") is not None
    with pytest.raises(ClusterSpecError, match="VERTEXRT_WORKERPOOL2"):
        cluster({"CLUSTER_SPEC": spec(pools, "workerpool0"), "VERTEXRT_WORKERPOOL2": "reducer"})


def test_evaluator_is_not_in_tf_config_cluster_nor_in_the_training_world() -> None:
    pools = {"workerpool0": [WP0], "workerpool1": WP1, "workerpool3": WP3}
    env = {
        "CLUSTER_SPEC": spec(pools, "workerpool3", 0),
        "TF_CONFIG": tf({"chief": [WP0], "worker": WP1}, "evaluator", 0),
    }
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        c = cluster(env)
    assert (c.role, c.rank, c.world_size, c.is_chief) == ("evaluator", -1, 3, False)
    from_tf = cluster({"TF_CONFIG": env["TF_CONFIG"]})
    assert (from_tf.source, from_tf.role, from_tf.rank) == ("TF_CONFIG", "evaluator", -1)


def test_hyperparameter_trial_id_from_task_or_environment() -> None:
    pools = {"workerpool0": [WP0]}
    assert cluster({"CLUSTER_SPEC": spec(pools, "workerpool0", trial="3")}).trial_id == "3"
    both = {"CLUSTER_SPEC": spec(pools, "workerpool0", trial="3"), "CLOUD_ML_TRIAL_ID": "4"}
    assert cluster(both).trial_id == "4"
    assert cluster({"CLUSTER_SPEC": spec(pools, "workerpool0", trial="")}).trial_id is None


def test_legacy_master_in_tf_config() -> None:
    pools = {"master": ["cmle-training-master-e1-0:2222"], "worker": [f"w{i}:2222" for i in range(4)]}
    master = cluster({"TF_CONFIG": tf(pools, "master", 0, cloud="w93a-ml")})
    assert (master.source, master.role, master.rank, master.world_size) == ("TF_CONFIG", "chief", 0, 5)
    assert master.chief_address == "cmle-training-master-e1-0:2222"
    worker = cluster({"TF_CONFIG": tf(pools, "worker", 3, trial="2")})
    assert (worker.rank, worker.task_index, worker.trial_id) == (4, 3, "2")


def test_legacy_names_in_cluster_spec() -> None:
    pools = {"master": ["m:2222"], "worker": ["w:2222"]}
    c = cluster({"CLUSTER_SPEC": spec(pools, "worker", 0)})
    assert (c.role, c.rank, c.world_size) == ("worker", 1, 2)


def test_tf_config_with_only_workers_makes_worker_zero_the_chief() -> None:
    pools = {"worker": ["127.0.0.1:1", "127.0.0.1:2"]}
    zero = cluster({"TF_CONFIG": tf(pools, "worker", 0)})
    one = cluster({"TF_CONFIG": tf(pools, "worker", "1")})  # type: ignore[arg-type]  # TF casts "1"
    assert (zero.is_chief, zero.rank, one.is_chief, one.rank) == (True, 0, False, 1)
    assert zero.chief_address == "127.0.0.1:1"
    assert cluster({"TF_CONFIG": "{}"}).source == "local"  # TF: '{}' means no cluster


def test_master_variables_are_node_level() -> None:
    c = cluster({"MASTER_ADDR": "10.0.0.2", "MASTER_PORT": "3333", "RANK": "2", "WORLD_SIZE": "4"})
    assert (c.source, c.role, c.task_index, c.rank, c.world_size) == ("MASTER_ADDR", "worker", 1, 2, 4)
    assert c.rendezvous_address == "10.0.0.2:3333"
    default_port = cluster({"MASTER_ADDR": "h", "RANK": "0", "WORLD_SIZE": "2"})
    assert default_port.rendezvous_address == "h:29500" and default_port.is_chief


def test_torchrun_inside_a_vertex_node() -> None:
    env = {
        "CLUSTER_SPEC": spec({"workerpool0": [WP0], "workerpool1": WP1[:1]}, "workerpool1", 0, trial="7"),
        "TF_CONFIG": tf({"chief": [WP0], "worker": WP1[:1]}, "worker", 0),
        "RANK": "5",
        "WORLD_SIZE": "8",
        "LOCAL_RANK": "1",
        "LOCAL_WORLD_SIZE": "4",
        "GROUP_RANK": "1",
        "GROUP_WORLD_SIZE": "2",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": "29400",
        "TORCHELASTIC_RUN_ID": "none",
    }
    c = cluster(env)
    assert (c.source, c.rank, c.world_size, c.local_rank, c.local_world_size) == ("torchrun", 5, 8, 1, 4)
    assert (c.node_rank, c.num_nodes, c.role, c.task_index, c.trial_id) == (1, 2, "worker", 0, "7")
    assert c.chief_address == WP0 and c.rendezvous_address == "127.0.0.1:29400"
    assert {p.name for p in c.pools} == {"workerpool0", "workerpool1"}
    derived = cluster({k: v for k, v in env.items() if not k.startswith("GROUP_")})
    assert (derived.node_rank, derived.num_nodes) == (1, 2)


def test_torchrun_without_any_cluster_variable() -> None:
    c = cluster({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2"})
    assert (c.source, c.role, c.is_chief, c.num_nodes, c.pools) == ("torchrun", "chief", True, 1, ())


def test_detection_order() -> None:
    pools = {"workerpool0": [WP0], "workerpool1": WP1[:1]}
    tf_config = tf({"chief": [WP0], "worker": WP1[:1]}, "chief", 0)
    master = {"MASTER_ADDR": "h", "MASTER_PORT": "1", "RANK": "0", "WORLD_SIZE": "2"}
    everything = {"CLUSTER_SPEC": spec(pools, "workerpool0"), "TF_CONFIG": tf_config, **master}
    assert cluster(everything).source == "CLUSTER_SPEC"
    assert cluster({"TF_CONFIG": tf_config, **master}).source == "TF_CONFIG"
    assert cluster(master).source == "MASTER_ADDR"
    assert cluster({**everything, "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1"}).source == "torchrun"


def test_cluster_spec_and_tf_config_that_disagree_warn_naming_both() -> None:
    pools = {"workerpool0": [WP0], "workerpool1": WP1}
    env = {
        "CLUSTER_SPEC": spec(pools, "workerpool1", 0),
        "TF_CONFIG": tf({"chief": [WP0], "worker": WP1}, "worker", 1),
    }
    with pytest.warns(ClusterSpecWarning, match=r"CLUSTER_SPEC says .* worker 0 but TF_CONFIG says worker 1"):
        c = cluster(env)
    assert c.task_index == 0  # CLUSTER_SPEC wins
    env["TF_CONFIG"] = tf({"chief": [WP0], "worker": ["elsewhere:2222", WP1[1]]}, "worker", 0)
    with pytest.warns(ClusterSpecWarning, match="CLUSTER_SPEC lists .* but TF_CONFIG lists"):
        cluster(env)
    with pytest.warns(ClusterSpecWarning, match="RANK=1 but RANK=2"):
        cluster({"CLUSTER_SPEC": spec(pools, "workerpool1", 0), "RANK": "2", "WORLD_SIZE": "3"})


@pytest.mark.parametrize(
    ("env", "names"),
    [
        ({"CLUSTER_SPEC": "{not json"}, ["CLUSTER_SPEC", "not valid JSON"]),
        ({"CLUSTER_SPEC": "[1, 2]"}, ["CLUSTER_SPEC", "JSON object"]),
        (
            {"CLUSTER_SPEC": spec({"workerpool0": [WP0], "workerpool7": WP1}, "workerpool0")},
            ["cluster.workerpool7"],
        ),
        ({"CLUSTER_SPEC": spec({"workerpool1": WP1}, "workerpool1")}, ["CLUSTER_SPEC", "workerpool0"]),
        (
            {"CLUSTER_SPEC": spec({"workerpool0": [WP0], "workerpool1": [WP0]}, "workerpool0")},
            ["appears twice"],
        ),
        (
            {"CLUSTER_SPEC": spec({"workerpool0": ["h:70000"]}, "workerpool0")},
            ["cluster.workerpool0[0]", "70000"],
        ),
        (
            {"CLUSTER_SPEC": spec({"workerpool0": ["h"]}, "workerpool0")},
            ["cluster.workerpool0[0]", "host:port"],
        ),
        (
            {"CLUSTER_SPEC": spec({"workerpool0": [WP0], "workerpool1": WP1}, "workerpool1", 2)},
            ["task.index 2"],
        ),
        ({"CLUSTER_SPEC": spec({"workerpool0": [WP0, WP1[0]]}, "workerpool0")}, ["exactly one"]),
        ({"CLUSTER_SPEC": spec({"workerpool0": [WP0]}, "workerpool9")}, ["task.type"]),
        ({"CLUSTER_SPEC": spec({"workerpool0": [WP0]}, "workerpool1")}, ["no 'workerpool1' pool"]),
        ({"CLUSTER_SPEC": json.dumps({"cluster": {"workerpool0": [WP0]}})}, ["CLUSTER_SPEC", "'task'"]),
        ({"TF_CONFIG": tf({"ps": WP2}, "ps", 0)}, ["TF_CONFIG", "no chief and no worker"]),
        ({"TF_CONFIG": tf({"worker": WP1}, "worker", True)}, ["TF_CONFIG", "task.index"]),  # type: ignore[arg-type]
        (
            {"TF_CONFIG": tf({"chief": [WP0], "master": WP1[:1]}, "chief")},
            ["cluster.chief", "cluster.master"],
        ),
        ({"RANK": "one", "WORLD_SIZE": "2"}, ["RANK='one'", "not an integer"]),
        ({"RANK": "2", "WORLD_SIZE": "2", "MASTER_ADDR": "h"}, ["RANK=2", "WORLD_SIZE=2"]),
        ({"RANK": "0"}, ["RANK", "WORLD_SIZE"]),
        ({"RANK": "1", "WORLD_SIZE": "2"}, ["MASTER_ADDR"]),
        ({"MASTER_ADDR": "h", "MASTER_PORT": "0", "RANK": "0", "WORLD_SIZE": "1"}, ["MASTER_PORT", "'0'"]),
        ({"LOCAL_RANK": "2", "LOCAL_WORLD_SIZE": "2", "RANK": "2", "WORLD_SIZE": "4"}, ["LOCAL_RANK=2"]),
        ({"LOCAL_RANK": "0", "RANK": "0", "WORLD_SIZE": "1"}, ["LOCAL_WORLD_SIZE"]),
        ({"TORCHELASTIC_RUN_ID": "x"}, ["LOCAL_RANK"]),
    ],
)
def test_bad_input_raises_cluster_spec_error_naming_variable_and_field(
    env: dict[str, str], names: list[str]
) -> None:
    with pytest.raises(ClusterSpecError) as caught:
        cluster(env)
    for name in names:
        assert name in str(caught.value)


def test_world_info_uses_the_cluster_when_torch_is_not_initialised(vertex_env, monkeypatch) -> None:
    vertex_env(workers=1, task=("workerpool1", 0))
    monkeypatch.delitem(sys.modules, "torch.distributed", raising=False)
    info = world_info()
    assert (info.rank, info.world_size, info.source, info.is_chief) == (1, 2, "CLUSTER_SPEC", False)


def test_summary_is_flat_and_readable() -> None:
    summary = Cluster(source="local").summary()
    assert summary["source"] == "local" and summary["rank"] == "0 of 1" and summary["is_chief"] is True


def test_the_package_stays_light_and_its_names_are_not_shadowed() -> None:
    code = (
        "import sys, vertexrt.distributed as d\n"
        "import vertexrt.distributed.detection, vertexrt.distributed.launcher\n"
        "import vertexrt.distributed.tensorflow, vertexrt.distributed.torch\n"
        "assert callable(d.cluster) and callable(d.tf_config), (d.cluster, d.tf_config)\n"
        "d.cluster(); d.world_info()\n"
        "print(sorted(m for m in ('torch', 'tensorflow', 'numpy', 'keras') if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


@pytest.mark.parametrize(
    ("env", "replica"),
    [
        ({}, "chief-0"),
        (
            {"CLUSTER_SPEC": spec({"workerpool0": [WP0], "workerpool1": WP1}, "workerpool1", 1)},
            "workerpool1-1",
        ),
        (
            {"CLUSTER_SPEC": spec({"workerpool0": [WP0], "workerpool2": WP2}, "workerpool2", 0)},
            "workerpool2-0",
        ),
        ({"TF_CONFIG": tf({"chief": ["a:1"], "worker": ["b:1", "c:1"]}, "worker", 1)}, "worker-1"),
        ({"MASTER_ADDR": "h", "RANK": "2", "WORLD_SIZE": "3"}, "worker-1"),
    ],
)
def test_replica_is_the_vertex_replica_name(env: dict[str, str], replica: str) -> None:
    c = cluster(env)
    assert c.replica == replica and c.summary()["replica"] == replica


def test_every_process_of_a_torchrun_replica_shares_its_name_and_only_rank_0_is_chief() -> None:
    node = spec({"workerpool0": [WP0], "workerpool1": WP1}, "workerpool0")
    procs = [
        cluster(
            {
                "CLUSTER_SPEC": node,
                "LOCAL_RANK": str(i),
                "LOCAL_WORLD_SIZE": "2",
                "RANK": str(i),
                "WORLD_SIZE": "6",
            }
        )
        for i in range(2)
    ]
    assert [p.replica for p in procs] == ["workerpool0-0", "workerpool0-0"]
    assert [p.is_chief for p in procs] == [True, False]


def test_cluster_spec_warning_is_a_vertexrt_warning_under_both_names() -> None:
    import vertexrt
    import vertexrt.distributed
    from vertexrt.errors import ClusterSpecWarning as FromErrors
    from vertexrt.errors import VertexrtWarning

    assert (
        ClusterSpecWarning
        is FromErrors
        is vertexrt.ClusterSpecWarning
        is vertexrt.distributed.ClusterSpecWarning
    )
    assert issubclass(FromErrors, VertexrtWarning) and issubclass(VertexrtWarning, UserWarning)


def test_world_info_outside_a_process_group_has_the_cluster_local_rank(vertex_env, monkeypatch) -> None:
    vertex_env(workers=1, task=("workerpool1", 0))
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "4")
    info = world_info()
    assert (info.rank, info.world_size, info.local_rank, info.local_world_size) == (3, 4, 1, 2)


def test_world_info_raises_on_a_malformed_variable(monkeypatch) -> None:
    monkeypatch.setenv("RANK", "one")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ClusterSpecError, match="RANK='one'"):
        world_info()


@pytest.mark.slow
def test_world_info_never_guesses_a_local_rank_the_process_group_contradicts(tmp_path) -> None:
    # A real gloo group of one process, while CLUSTER_SPEC says worker 0 of a 2-replica job (rank 1 of 2):
    # torch.distributed's rank wins; which GPU this process owns is unknown, so local_rank raises.
    store = (tmp_path / "store").as_uri()
    code = (
        "import json, torch.distributed as dist\n"
        "from vertexrt.distributed import world_info\n"
        "from vertexrt.errors import ClusterSpecError\n"
        f"dist.init_process_group('gloo', init_method={store!r}, rank=0, world_size=1)\n"
        "info = world_info()\n"
        "try:\n"
        "    local = info.local_rank\n"
        "except ClusterSpecError as err:\n"
        "    local = str(err)\n"
        "print(json.dumps([info.rank, info.world_size, info.source, info.is_chief, local]))\n"
        "dist.destroy_process_group()\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "TF_CONFIG")}
    env["CLUSTER_SPEC"] = spec({"workerpool0": [WP0], "workerpool1": WP1[:1]}, "workerpool1", 0)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr
    rank, world_size, source, is_chief, local = json.loads(out.stdout.strip().splitlines()[-1])
    assert (rank, world_size, source, is_chief) == (0, 1, "torch.distributed", True)
    assert "LOCAL_RANK" in local and "rank 1 of 2" in local

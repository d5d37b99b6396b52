"""Fuzzing every cluster variable: only ClusterSpecError may come out, naming the variable (and field)."""

from __future__ import annotations

import json
import sys
import warnings

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vertexrt.distributed import Cluster, cluster
from vertexrt.errors import ClusterSpecError, ClusterSpecWarning

POOL_NAMES = [
    "workerpool0",
    "workerpool1",
    "workerpool2",
    "workerpool3",
    "chief",
    "master",
    "worker",
    "ps",
    "evaluator",
    "workerpool4",
    "",
    "WORKERPOOL0",
]
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=10,
)
ports = st.one_of(st.integers(-2, 70000).map(str), st.sampled_from(["", "22a", " 1", "٣"]))
hosts = st.sampled_from(["127.0.0.1", "cmle-training-workerpool0-ab-0", "h", "", " h", "[::1]"])
addresses = st.one_of(st.builds(lambda h, p: f"{h}:{p}", hosts, ports), json_values)
pools = st.dictionaries(
    st.sampled_from(POOL_NAMES), st.one_of(st.lists(addresses, max_size=3), json_values), max_size=4
)
tasks = st.fixed_dictionaries(
    {},
    optional={
        "type": st.one_of(st.sampled_from(POOL_NAMES), json_values),
        "index": st.one_of(st.integers(-1, 4), st.sampled_from(["0", "1", "x", True]), json_values),
        "trial": st.one_of(st.sampled_from(["", "3", 3]), json_values),
    },
)
near_valid = st.builds(
    lambda c, t, extra: json.dumps({"cluster": c, "task": t, **extra}),
    pools,
    tasks,
    st.dictionaries(st.sampled_from(["job", "environment"]), json_values, max_size=2),
)
documents = st.one_of(st.text(max_size=40), json_values.map(json.dumps), near_valid)


def check(env: dict[str, str], variable: str, structured: bool = False) -> None:
    try:
        result = cluster(env)
    except ClusterSpecError as err:
        assert variable in str(err), str(err)
        if structured and not str(err).startswith(f"{variable} must be a JSON object"):
            assert any(f in str(err) for f in ("cluster", "task", "VERTEXRT_WORKERPOOL2")), str(err)
        return
    assert isinstance(result, Cluster)
    if result.in_training_world:
        assert 0 <= result.rank < result.world_size and 0 <= result.node_rank < result.num_nodes
    else:
        assert result.rank == result.node_rank == -1


@settings(max_examples=300, deadline=None)
@given(documents)
def test_cluster_spec_fuzz(text: str) -> None:
    check({"CLUSTER_SPEC": text}, "CLUSTER_SPEC", structured=text.startswith('{"cluster"'))


@settings(max_examples=300, deadline=None)
@given(documents)
def test_tf_config_fuzz(text: str) -> None:
    check({"TF_CONFIG": text}, "TF_CONFIG", structured=text.startswith('{"cluster"'))


TORCHRUN_VARIABLES = [
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "RANK",
    "WORLD_SIZE",
    "GROUP_RANK",
    "GROUP_WORLD_SIZE",
]
integers_as_text = st.one_of(st.integers(-3, 10).map(str), st.text(max_size=4))


@settings(max_examples=300, deadline=None)
@given(
    st.dictionaries(
        st.sampled_from(["RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"]),
        st.one_of(integers_as_text, st.sampled_from(["h", " ", "", "1.5", "65536"])),
        min_size=1,
    )
)
def test_master_variables_fuzz(env: dict[str, str]) -> None:
    try:
        result = cluster(env)
    except ClusterSpecError as err:  # names the malformed variable, or the one that is missing
        assert any(name in str(err) for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")), str(
            err
        )
        return
    assert 0 <= result.rank < result.world_size


@settings(max_examples=300, deadline=None)
@given(
    st.dictionaries(
        st.sampled_from(TORCHRUN_VARIABLES),
        integers_as_text,
    ),
    st.booleans(),
)
def test_torchrun_variables_fuzz(env: dict[str, str], elastic: bool) -> None:
    if elastic:
        env["TORCHELASTIC_RUN_ID"] = "run"
    try:
        result = cluster(env)
    except ClusterSpecError as err:  # names the malformed variable, or the one that is missing
        assert any(name in str(err) for name in TORCHRUN_VARIABLES), str(err)
        return
    assert 0 <= result.rank < result.world_size and 0 <= result.local_rank < result.local_world_size


@settings(max_examples=100, deadline=None)
@given(st.integers(0, 4), st.integers(0, 3), st.booleans(), st.data())
def test_valid_specs_rank_every_training_process_once(workers: int, ps: int, evaluator: bool, data) -> None:
    layout = {"workerpool0": ["h0:2222"]}
    if workers:
        layout["workerpool1"] = [f"w{i}:2222" for i in range(workers)]
    if ps:
        layout["workerpool2"] = [f"p{i}:2222" for i in range(ps)]
    if evaluator:
        layout["workerpool3"] = ["e0:2222"]
    trial = data.draw(st.sampled_from(["", "1", "12"]))
    ranks = []
    for pool, addresses in layout.items():
        for index in range(len(addresses)):
            task = {"type": pool, "index": index, "trial": trial}
            c = cluster({"CLUSTER_SPEC": json.dumps({"cluster": layout, "task": task})})
            assert c.world_size == 1 + workers and c.trial_id == (trial or None)
            if pool in ("workerpool0", "workerpool1"):
                ranks.append(c.rank)
            else:
                assert not c.in_training_world and not c.is_chief
    assert sorted(ranks) == list(range(1 + workers))


# Hostile values: bounded before anything is parsed or converted, a ClusterSpecError naming the variable.
HUGE = "9" * 5000  # past Python's 4300-digit int() limit, which raises a bare ValueError
SPEC_OK = json.dumps({"cluster": {"workerpool0": ["h:2222"]}, "task": {"type": "workerpool0", "index": 0}})
NESTINGS = [
    "{0}",
    '{{"cluster": {0}}}',
    '{{"cluster": {{"workerpool0": {0}}}}}',
    '{{"cluster": {{"workerpool0": ["h:1"]}}, "task": {{"type": {0}}}}}',
    '{{"cluster": {{"workerpool0": ["h:1"]}}, "task": {{"type": "workerpool0", "trial": {0}}}}}',
]


@pytest.mark.parametrize("variable", ["CLUSTER_SPEC", "TF_CONFIG"])
@pytest.mark.parametrize("template", NESTINGS)
def test_deeply_nested_json_is_a_cluster_spec_error(variable: str, template: str) -> None:
    # Every depth around the interpreter's recursion limit: json.loads may succeed where re-encoding the
    # value for the message would not.
    for depth in [100, 2000, 100_000, *range(sys.getrecursionlimit() - 150, sys.getrecursionlimit() + 10)]:
        text = template.format("[" * depth + "]" * depth)
        with pytest.raises(ClusterSpecError, match=f"{variable}.*nested"):
            cluster({variable: text})


def test_deeply_nested_tf_config_beside_cluster_spec_is_only_a_warning() -> None:
    with pytest.warns(ClusterSpecWarning, match="TF_CONFIG.*nested"):
        assert cluster({"CLUSTER_SPEC": SPEC_OK, "TF_CONFIG": "[" * 100_000}).rank == 0


def test_an_oversized_cluster_variable_is_refused_before_parsing() -> None:
    text = json.dumps(
        {"cluster": {"workerpool0": ["h:2222"]}, "task": {"type": "workerpool0"}, "x": "a" * 2**21}
    )
    with pytest.raises(ClusterSpecError, match="CLUSTER_SPEC.*characters"):
        cluster({"CLUSTER_SPEC": text})


@pytest.mark.parametrize(
    ("env", "name"),
    [
        ({"RANK": HUGE, "WORLD_SIZE": "2", "MASTER_ADDR": "h"}, "RANK"),
        ({"RANK": "0", "WORLD_SIZE": HUGE, "MASTER_ADDR": "h"}, "WORLD_SIZE"),
        ({"RANK": "-" + HUGE, "WORLD_SIZE": "2", "MASTER_ADDR": "h"}, "RANK"),
        ({"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "h", "MASTER_PORT": HUGE}, "MASTER_PORT"),
        (
            {"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "h", "MASTER_PORT": "0" * 5000 + "1"},
            "MASTER_PORT",
        ),
        ({"LOCAL_RANK": HUGE, "LOCAL_WORLD_SIZE": "1", "RANK": "0", "WORLD_SIZE": "1"}, "LOCAL_RANK"),
        (
            {"LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1", "RANK": "0", "WORLD_SIZE": "1", "GROUP_RANK": HUGE},
            "GROUP_RANK",
        ),
        (
            {
                "CLUSTER_SPEC": json.dumps(
                    {"cluster": {"workerpool0": [f"h:{HUGE}"]}, "task": {"type": "workerpool0"}}
                )
            },
            "CLUSTER_SPEC",
        ),
        (
            {
                "TF_CONFIG": json.dumps(
                    {"cluster": {"chief": ["h:1"]}, "task": {"type": "chief", "index": HUGE}}
                )
            },
            "TF_CONFIG",
        ),
    ],
)
def test_a_huge_number_is_a_cluster_spec_error_naming_the_variable(env: dict[str, str], name: str) -> None:
    with pytest.raises(ClusterSpecError) as caught:
        cluster(env)
    assert name in str(caught.value) and len(str(caught.value)) < 500


@pytest.mark.parametrize("rank", [HUGE, "²", "１"])
def test_a_malformed_rank_beside_cluster_spec_does_not_crash_the_consistency_check(rank: str) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert cluster({"CLUSTER_SPEC": SPEC_OK, "RANK": rank}).rank == 0


@settings(max_examples=200, deadline=None)
@given(st.sampled_from(["MASTER_PORT", "RANK", "WORLD_SIZE"]), st.integers(-(10**30), 10**30))
def test_ports_and_ranks_outside_their_range_are_refused(name: str, value: int) -> None:
    env = {"MASTER_ADDR": "h", "RANK": "0", "WORLD_SIZE": "1", name: str(value)}
    try:
        c = cluster(env)
    except ClusterSpecError as err:
        assert name in str(err), str(err)
        return
    valid = {"MASTER_PORT": 1 <= value <= 65535, "RANK": value == 0, "WORLD_SIZE": value >= 1}
    assert valid[name] and (c.rank, c.world_size) == (0, 1 if name != "WORLD_SIZE" else value)

"""The state tree encoding on its own: what is accepted, what is refused and where."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch

from vertexrt.checkpoint import serialization
from vertexrt.errors import CheckpointError


def _round_trip(state):
    tree, leaves = serialization.encode(state, allow_pickle=False)
    values = {id(node): enc for node, enc in leaves}

    def value(node):
        enc = values[id(node)]
        if enc.kind == "torch":
            return (
                torch.from_numpy(enc.data.copy()).view(getattr(torch, node["dtype"])).reshape(node["shape"])
            )
        if enc.kind == "bytes":
            return enc.data.tobytes()
        out = enc.data.copy().view(np.dtype(node["dtype"])).reshape(node["shape"])
        return out[()] if node.get("scalar") else out

    return tree, serialization.decode(tree, value)


def test_json_values_stay_inline_and_keys_keep_their_type():
    tree, got = _round_trip({"a": 1, 2: [True, None, "s", 1.5], None: (), 1.5: -(2**70), "n": float("nan")})
    assert tree["k"] == ["a", 2, None, 1.5, "n"]
    assert got["a"] == 1 and got[2] == [True, None, "s", 1.5] and got[None] == ()
    assert got[1.5] == -(2**70) and got["n"] != got["n"]


def test_tensors_become_leaves_in_tree_order():
    tree, leaves = serialization.encode({"w": torch.ones(2, 3), "x": [np.arange(4)]}, allow_pickle=False)
    assert [n["t"] for n in serialization.leaf_nodes(tree)] == ["torch", "numpy"]
    assert [node["shape"] for node, _ in leaves] == [[2, 3], [4]]


@pytest.mark.parametrize(
    ("state", "path"),
    [
        ({"a": {("t", 1): 1}}, r"state\['a'\]: key \('t', 1\)"),
        ({"a": [1, object()]}, r"state\['a'\]\[1\]: cannot save an object of type builtins.object"),
        ({"s": torch.ones(3).to_sparse()}, r"state\['s'\]: cannot save a torch.sparse_coo"),
        ({"o": np.array([object()])}, r"state\['o'\]: cannot save a numpy array of dtype object"),
    ],
)
def test_unsupported_values_name_their_path(state, path):
    with pytest.raises(CheckpointError, match=path):
        serialization.encode(state, allow_pickle=False)


def test_importing_the_package_loads_no_framework():
    code = (
        "import sys, vertexrt.checkpoint as c; c.CheckpointManager; c.EveryNSteps; c.rng_state; "
        "print(sorted(m for m in ('numpy', 'torch', 'tensorflow', 'gcsfs') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "[]"

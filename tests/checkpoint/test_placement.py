"""Where restored tensors go, which generator states are set, how metrics are read: the logic of the CUDA
path that runs without a GPU (tests/checkpoint/test_cuda.py checks it on one)."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch

from vertexrt.checkpoint import CheckpointManager, restoring, rng_state, serialization
from vertexrt.checkpoint.rng import cuda_states_to_set
from vertexrt.errors import CheckpointError


def _trained() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.randn(5, 3)).sum().backward()
    opt.step()
    return model, opt


def _placed(state: object) -> dict[tuple[str | None, tuple[object, ...]], bool]:
    """For each leaf of ``state``'s encoding: (owner, keys) -> whether restore(device=...) moves it."""
    tree, leaves = serialization.encode(state, allow_pickle=False)
    places = serialization.leaf_places(tree)
    return {
        places[id(node)]: restoring.moves(*places[id(node)], torch.empty(node["shape"]))
        for node, _ in leaves
        if node["t"] == "torch"
    }


def test_device_moves_model_and_optimizer_data_but_not_rng_state_or_step_counters():
    model, opt = _trained()
    placed = _placed({"model": model, "opt": opt, "rng": rng_state()})
    adam = f"{type(opt).__module__}.{type(opt).__qualname__}"
    sequential = f"{type(model).__module__}.{type(model).__qualname__}"
    assert placed[(adam, ("state", 0, "step"))] is False  # Adam keeps step where it is given
    assert placed[(adam, ("state", 0, "exp_avg"))] is True
    assert placed[(adam, ("state", 1, "exp_avg_sq"))] is True
    assert placed[(sequential, ("0.weight",))] is True
    assert placed[(sequential, ("1.num_batches_tracked",))] is True  # a 0-d buffer of the model moves
    rng = [(owner, keys) for owner, keys in placed if owner == restoring.RNG_STATE_CLASS]
    assert rng and not any(placed[key] for key in rng)  # the torch ByteTensor state stays on the CPU


def test_step_counters_of_an_optimizer_state_dict_saved_as_a_plain_dict_stay_too():
    _, opt = _trained()
    placed = _placed({"opt": opt.state_dict(), "step": torch.tensor(3)})
    assert placed[(None, ("opt", "state", 0, "step"))] is False
    assert placed[(None, ("opt", "state", 0, "exp_avg"))] is True
    assert placed[(None, ("step",))] is True  # a user's own 'step' tensor is data


def test_the_rng_owner_name_is_the_class_the_tree_records():
    tree, _ = serialization.encode({"rng": rng_state()}, allow_pickle=False)
    assert tree["v"][0]["cls"] == restoring.RNG_STATE_CLASS


@pytest.mark.parametrize(
    ("saved", "indices", "current", "count", "expected"),
    [
        (3, {3}, 5, 8, 5),  # 8 processes x 8 visible GPUs: process 5 saved on cuda:3? it restores on its own
        (5, {5}, 0, 1, 0),  # one GPU visible per process (CUDA_VISIBLE_DEVICES): cuda:0
        (0, {0}, 6, 8, 6),  # never everybody on cuda:0
        (1, {0, 1}, 0, 8, 1),  # state spread over two GPUs keeps its layout where it fits
        (5, {4, 5}, 2, 4, 2),  # ... and falls back to the current device where it does not
        (None, set(), 3, 4, 3),
    ],
)
def test_saved_device_indices_follow_the_current_device(saved, indices, current, count, expected):
    assert restoring.saved_cuda_index(saved, indices, current, count) == expected


def test_cuda_rng_states_of_gpus_not_visible_are_skipped_with_a_warning(caplog):
    assert cuda_states_to_set(8, 3, visible=8, current=3) == {i: i for i in range(8)}
    assert cuda_states_to_set(1, 0, visible=4, current=2) == {0: 0}
    assert not caplog.text
    with caplog.at_level(logging.WARNING, logger="vertexrt.checkpoint.rng"):
        assert cuda_states_to_set(2, 1, visible=1, current=0) == {0: 1}  # saved with 2 visible, loaded on 1
        assert cuda_states_to_set(8, None, visible=1, current=0) == {0: 0}  # older checkpoints: no current
        assert cuda_states_to_set(8, 6, visible=2, current=1) == {0: 0, 1: 6}
    assert caplog.text.count("RNG states of 8 GPUs but 1 are visible") == 1
    assert "skipped" in caplog.text


@pytest.mark.parametrize("async_save", [False, True])
def test_tensor_metrics_are_saved_without_item_on_the_calling_thread(tmp_path, monkeypatch, async_save):
    """save() snapshots a tensor metric and reads it when the manifest is written; ``.item()`` (a GPU sync
    for a CUDA value) is never called."""

    def no_item(self: torch.Tensor) -> float:
        raise AssertionError("save() called .item() on a metric")

    loss = torch.tensor(0.25)
    monkeypatch.setattr(torch.Tensor, "item", no_item)
    with CheckpointManager(str(tmp_path), async_save=async_save, rank=0, world_size=1) as mgr:
        mgr.save(1, {"w": torch.ones(2)}, metrics={"loss": loss, "acc": np.float32(0.5), "n": 3})
        loss.fill_(9.0)  # the next step changes it: the saved value is the one at save()
        mgr.wait()
        assert mgr.metadata(1)["metrics"] == {"loss": 0.25, "acc": 0.5, "n": 3.0}


def test_a_tensor_metric_of_several_values_is_a_clear_error(tmp_path):
    error = pytest.raises(CheckpointError, match=r"metrics\['loss'\] is a tensor of shape \[2\]")
    with CheckpointManager(str(tmp_path), async_save=False, rank=0, world_size=1) as mgr, error:
        mgr.save(1, {"w": torch.ones(2)}, metrics={"loss": torch.ones(2)})


def test_leaves_with_a_live_target_are_copied_into_it_without_an_intermediate_placed_tensor():
    """restore(target=..., device=...) fills a live tensor straight from the verified host bytes; only
    leaves without a live target (here: one the target lacks) go through the device placement."""
    tree, leaves = serialization.encode({"a": torch.arange(4.0), "b": torch.ones(2)}, allow_pickle=False)
    by_node = {id(node): enc.data for node, enc in leaves}
    placed: list[list[int]] = []

    def values(node: dict) -> torch.Tensor:
        return torch.from_numpy(by_node[id(node)].copy()).view(torch.float32)

    def place(node: dict, value: torch.Tensor) -> torch.Tensor:
        placed.append(node["shape"])
        return value

    live = torch.zeros(4)
    out = serialization.decode(tree, values, {"a": live}, place)
    assert out["a"] is live and torch.equal(live, torch.arange(4.0))
    assert torch.equal(out["b"], torch.ones(2)) and placed == [[2]]

"""Live CPU leaves that a saved optimizer owns are copied in the background; the next optimizer step waits.

The copies are held deterministically by a pool that runs a task only when something waits for its
result: a copy nobody waited for has not happened, so a step that forgot to wait would save its own
changes instead of the state at save time.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable
from concurrent.futures import Executor, Future
from typing import Any

import numpy as np
import pytest
import torch
from torch.optim import optimizer as torch_optimizer

from vertexrt.checkpoint import CheckpointManager, EveryNSteps, FastTier, serialization, staging
from vertexrt.checkpoint.tiers import config
from vertexrt.errors import CheckpointError

WIDTH = 32


class _Lazy(Future):  # type: ignore[type-arg]
    """A task that runs (on the waiting thread) when its result or exception is first asked for."""

    def __init__(self, call: Callable[[], Any]) -> None:
        super().__init__()
        self._call: Callable[[], Any] | None = call
        self._taken = threading.Lock()

    def _run(self) -> None:
        with self._taken:
            call, self._call = self._call, None
        if call is None:
            return
        try:
            self.set_result(call())
        except BaseException as exc:
            self.set_exception(exc)

    def result(self, timeout: float | None = None) -> Any:
        self._run()
        return super().result(timeout)

    def exception(self, timeout: float | None = None) -> BaseException | None:
        self._run()
        return super().exception(timeout)


class _OnDemandPool(Executor):
    """A copy pool under the test's control: nothing runs until waited for."""

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future[Any]:
        return _Lazy(lambda: fn(*args, **kwargs))


def _model_and_sgd() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(WIDTH, WIDTH), torch.nn.BatchNorm1d(WIDTH), torch.nn.Linear(WIDTH, 1)
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    _train(model, opt, 1)  # the momentum buffers exist from here on
    return model, opt


def _train(model: torch.nn.Module, opt: torch.optim.Optimizer, steps: int) -> None:
    for _ in range(steps):
        opt.zero_grad()
        model(torch.randn(16, WIDTH)).square().mean().backward()  # BatchNorm statistics change here
        opt.step()


def _encoded(state: Any) -> list[Any]:
    return [enc for _, enc in serialization.encode(state, allow_pickle=False)[1]]


def _step_hooks() -> int:
    return len(torch_optimizer._global_optimizer_pre_hooks)


def test_cpu_parameters_and_optimizer_state_are_optimizer_owned_and_buffers_are_not():
    model, opt = _model_and_sgd()
    encoded = _encoded({"model": model, "opt": opt, "plain": torch.ones(3), "array": np.ones(3)})
    owned = {int(e.data.ctypes.data) for e in encoded if e.optimizer_owned}
    params = {p.data_ptr() for p in model.parameters()}
    momenta = {s["momentum_buffer"].data_ptr() for s in opt.state.values()}
    assert owned == params | momenta and len(owned) == 12  # 6 parameters, 6 momentum buffers
    buffers = {b.data_ptr() for b in model.buffers()}
    assert all(not e.optimizer_owned for e in encoded if int(e.data.ctypes.data) in buffers)


def test_stage_returns_before_optimizer_owned_copies_and_the_next_step_waits_for_them():
    model, opt = _model_and_sgd()
    encoded = _encoded({"model": model, "opt": opt})
    at_save = [np.array(e.data, copy=True) for e in encoded]
    owned = [i for i, e in enumerate(encoded) if e.optimizer_owned]
    hooks = _step_hooks()
    stager = staging.Stager(threads=2, pool=_OnDemandPool())
    staged = stager.stage(encoded, copy_host=True)
    assert sorted(staged.copies) == owned
    assert not any(f.done() for i in owned for f in staged.copies[i])  # stage() did not wait for them
    for i in set(range(len(encoded))) - set(owned):  # buffers: copied before stage() returned
        assert np.array_equal(staged[i], at_save[i]), i
    assert _step_hooks() == hooks + 1
    _train(model, opt, 2)  # forward + backward, then the step: it waits for the copies before it changes
    assert all(f.done() for i in owned for f in staged.copies[i])
    assert not any(np.array_equal(encoded[i].data, at_save[i]) for i in owned)  # the steps changed them
    for i, want in enumerate(at_save):
        staged.ready(i)
        assert np.array_equal(staged[i], want), i
    stager.close()
    assert _step_hooks() == hooks


def _with_a_broken_owned_leaf() -> tuple[Any, Any, list[Any], int]:
    """A model, its SGD, their encoded leaves and the index of an optimizer-owned leaf whose copy will fail
    (its data is float64, not bytes)."""
    model, opt = _model_and_sgd()
    encoded = _encoded({"model": model, "opt": opt})
    broken = next(i for i, e in enumerate(encoded) if e.optimizer_owned)
    encoded[broken] = dataclasses.replace(encoded[broken], data=np.linspace(0.0, 1.0, 64))
    return model, opt, encoded, broken


def test_a_failed_background_copy_fails_its_leaf_and_is_raised_once_at_the_next_step():
    model, opt, encoded, broken = _with_a_broken_owned_leaf()
    hooks = _step_hooks()
    stager = staging.Stager(threads=2, pool=_OnDemandPool())
    staged = stager.stage(encoded, copy_host=True)
    with pytest.raises(CheckpointError, match=rf"leaf {broken} \(64 bytes\).*failed: .*Cannot cast"):
        staged.ready(broken)  # the writer's wait: this save fails
    with pytest.raises(CheckpointError, match=r"leaves \[.*\] into host memory failed: .*Cannot cast"):
        _train(model, opt, 1)
    _train(model, opt, 1)  # raised once
    stager.close()
    assert _step_hooks() == hooks


def test_two_stagers_with_pending_copies_do_not_break_the_optimizer_step():
    """The fast and the durable tier both save at a step: each stager's step hook waits; neither removes
    itself while torch iterates over the hooks (that raised "OrderedDict mutated during iteration")."""
    model, opt = _model_and_sgd()
    hooks = _step_hooks()
    barriers = [staging.OptimizerStepBarrier() for _ in range(2)]
    copies = [_OnDemandPool().submit(lambda: None) for _ in barriers]
    for barrier, copy in zip(barriers, copies, strict=True):
        barrier.add_copy(copy, [0])
    _train(model, opt, 2)
    assert all(copy.done() for copy in copies)
    for barrier in barriers:
        barrier.release()
    assert _step_hooks() == hooks


def test_a_failed_copy_no_step_waited_for_is_raised_by_close():
    model, opt, encoded, broken = _with_a_broken_owned_leaf()
    hooks = _step_hooks()
    stager = staging.Stager(threads=2, pool=_OnDemandPool())
    stager.stage(encoded, copy_host=True)
    with pytest.raises(CheckpointError, match="background copy of checkpoint leaves"):
        stager.close()
    assert _step_hooks() == hooks
    stager.close()  # nothing left to raise


@pytest.mark.parametrize("tier", ["durable async", "fast", "both"])
def test_a_save_holds_the_state_at_save_time_after_the_next_steps_and_close_leaves_nothing(
    tmp_path, monkeypatch, tier
):
    monkeypatch.setenv(config.LOCAL_DIR_VARIABLE, str(tmp_path / "local"))
    model, opt = _model_and_sgd()
    state = {"model": model, "opt": opt}
    hooks = _step_hooks()
    options: dict[str, Any] = {"async_save": True, "save_policy": EveryNSteps(100 if tier == "fast" else 1)}
    if tier != "durable async":
        options["fast"] = FastTier(every=EveryNSteps(1), peers=0)
    durable = str(tmp_path / "durable")
    with CheckpointManager(durable, rank=0, world_size=1, **options) as mgr:
        want = {k: v.clone() for k, v in model.state_dict().items()}
        momenta = [s["momentum_buffer"].clone() for s in opt.state.values()]
        mgr.save(1, state)
        assert _step_hooks() == hooks + (2 if tier == "both" else 1)  # the moments' copies are pending
        _train(model, opt, 3)
    assert _step_hooks() == hooks
    assert not any(t.name.startswith("vertexrt-ckpt-copy") for t in threading.enumerate())
    with CheckpointManager(durable, rank=0, world_size=1, **options) as mgr:
        got = mgr.restore()
        assert mgr.restored_step == 1
    for name, tensor in want.items():
        assert torch.equal(got["model"][name], tensor), name
    saved = [s["momentum_buffer"] for s in got["opt"]["state"].values()]
    assert all(torch.equal(a, b) for a, b in zip(saved, momenta, strict=True))

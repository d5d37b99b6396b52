"""benchmarks/recovery.py: the durable-only baseline's interval k' derived from the blockings measured.

Pure arithmetic on the per-step blocking that the ranks report (no processes, no timings asserted): the
fast configuration's blocking per step (step 0 left out) and one durable save's blocking (the steps that
saved, step 0 left out) give k' = ceil(durable per save / fast per step); a k' derived from a sparser run
is checked by a run at k' itself (a save waits for the previous one still writing when saves come faster).
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _recovery() -> ModuleType:
    spec = importlib.util.spec_from_file_location("recovery_benchmark", ROOT / "benchmarks" / "recovery.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_k_prime_is_one_durable_save_over_the_fast_blocking_per_step():
    recovery = _recovery()
    # fast run: step 0 sets the staging up (left out); 2 ms a step, 12 ms at its durable step 5
    fast = {"0": 9.0, **{str(s): 0.002 for s in range(1, 11)}, "5": 0.012}  # 30 ms over 10 steps
    # durable only, saves at 0, 5, 10: 40 and 48 ms; the steps between block 1 ms, not a save's cost (counted
    # in, as "blocking per step x 5", they would give 48 ms a save and k' = 16)
    durable = {"0": 9.0, **{str(s): 0.001 for s in range(1, 11)}, "5": 0.040, "10": 0.048}
    budget = recovery.same_budget(fast, durable, [0, 5, 10], every=5)
    assert budget.fast_per_step == pytest.approx(0.003)
    assert budget.durable_per_save == pytest.approx(0.044)
    assert budget.interval == 15  # ceil(44 / 3)
    assert "= 15" in budget.derivation()
    # the baseline then blocks no more per step than the fast configuration
    assert budget.durable_per_save / budget.interval <= budget.fast_per_step
    # measured saving every 5, k' = 15 is a guess to check by a run at 15; measured at 15, it is k'
    assert (budget.within, recovery.next_every(budget)) == (False, 15)
    settled = recovery.same_budget(fast, durable, [0, 5, 10], every=15)
    assert (settled.within, recovery.next_every(settled)) == (True, None)


def test_k_prime_grows_when_saves_wait_for_the_previous_write():
    recovery = _recovery()
    fast = {str(s): 0.04 for s in range(49)}  # 40 ms a step
    # every 4 steps the previous save is still writing: each save waits, 530 ms, over the budget
    crowded = recovery.same_budget(fast, {"4": 0.53, "8": 0.53}, [4, 8], every=4)
    assert (crowded.interval, recovery.next_every(crowded)) == (14, 14)


def test_k_prime_needs_a_durable_save_after_step_0_and_a_fast_blocking():
    recovery = _recovery()
    with pytest.raises(ValueError, match="no durable save after step 0"):
        recovery.same_budget({"1": 0.001}, {"0": 1.0, "1": 0.0}, [0], every=1)
    with pytest.raises(ValueError, match="never blocked"):
        recovery.same_budget({"0": 1.0, "1": 0.0}, {"5": 0.04}, [5], every=5)

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
    # measured saving every 5, over the budget: the next run saves every 15
    assert (budget.within, recovery.next_every([budget])) == (False, 15)


def test_k_prime_is_the_shortest_interval_measured_within_the_budget():
    recovery = _recovery()

    def run(every: int, per_save_ms: float) -> object:  # the fast configuration blocks 15.7 ms a step
        fast = {str(s): 0.0157 for s in range(49)}
        return recovery.same_budget(fast, {str(every): per_save_ms / 1e3}, [every], every=every)

    measured = [run(10, 19.0)]  # within (1.9 ms a step), its k' = 2
    assert recovery.next_every(measured) == 2
    measured.append(run(2, 321.3))  # saves wait for the previous write: over, its k' = 21 (past 10)
    assert recovery.next_every(measured) == 6  # between 2 (over) and 10 (within)
    measured.append(run(6, 60.0))  # within
    assert recovery.next_every(measured) == 4
    measured.append(run(4, 80.0))  # over (20 ms a step)
    assert recovery.next_every(measured) == 5
    measured.append(run(5, 70.0))  # within (14 ms a step)
    assert recovery.next_every(measured) is None
    assert recovery.k_prime(measured) == 5


def test_k_prime_needs_a_durable_save_after_step_0_and_a_fast_blocking():
    recovery = _recovery()
    with pytest.raises(ValueError, match="no durable save after step 0"):
        recovery.same_budget({"1": 0.001}, {"0": 1.0, "1": 0.0}, [0], every=1)
    with pytest.raises(ValueError, match="never blocked"):
        recovery.same_budget({"0": 1.0, "1": 0.0}, {"5": 0.04}, [5], every=5)

"""``YoungDaly``: the durable interval from the save cost and the mean time between failures (pure: the clock
is the ``LastSave`` the policy is asked with, costs and failures are told), and the manager telling it the
cost of each durable save."""

from __future__ import annotations

import logging
import math
from pathlib import Path

import pytest

from vertexrt.checkpoint import CheckpointManager, EveryNSteps, LastSave, YoungDaly
from vertexrt.checkpoint.policies import DEFAULT_MTBF, daly_interval, observe_save_cost
from vertexrt.errors import ConfigError


@pytest.fixture(autouse=True)
def no_mtbf_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("VERTEXRT_MTBF", raising=False)


def asked(policy: YoungDaly, *, seconds_since_save: float, step: int = 10) -> bool:
    return policy.should_save(
        step, LastSave(step=5, time=1000.0, now=1000.0 + seconds_since_save, start_time=0.0)
    )


def test_daly_s_interval_is_young_s_to_first_order_and_the_mtbf_when_a_save_costs_more_than_2m() -> None:
    cost, mtbf = 60.0, 86_400.0
    ratio = cost / (2 * mtbf)
    expected = math.sqrt(2 * cost * mtbf) * (1 + math.sqrt(ratio) / 3 + ratio / 9) - cost
    assert daly_interval(cost, mtbf) == pytest.approx(expected)
    assert daly_interval(cost, mtbf) == pytest.approx(3180.1, abs=0.1)
    assert daly_interval(0.01, 1e6) == pytest.approx(math.sqrt(2 * 0.01 * 1e6), rel=1e-3)  # Young's
    assert daly_interval(300.0, 100.0) == 100.0


def test_the_interval_is_clamped_and_decides_the_save() -> None:
    policy = YoungDaly(save_seconds=60.0, mtbf_seconds=86_400.0, minimum=60, maximum=7200)
    assert policy.interval() == pytest.approx(daly_interval(60.0, 86_400.0))
    assert not asked(policy, seconds_since_save=3000)
    assert asked(policy, seconds_since_save=3200)
    assert not asked(policy, seconds_since_save=3200, step=5)  # the step saved last: never twice
    assert YoungDaly(save_seconds=1.0, mtbf_seconds=100.0, minimum=60).interval() == 60.0
    assert YoungDaly(save_seconds=600.0, mtbf_seconds=1e7, maximum=7200).interval() == 7200.0
    first = LastSave(step=None, time=None, now=500.0, start_time=0.0)  # no save yet: since the start
    assert YoungDaly(save_seconds=1.0, mtbf_seconds=100.0, minimum=400).should_save(3, first)


def test_the_observed_save_cost_replaces_the_assumed_one_and_is_the_mean_of_the_last_five() -> None:
    unknown = YoungDaly(mtbf_seconds=86_400.0, minimum=120)
    assert unknown.cost() is None and unknown.interval() == 120.0  # the first save comes early
    policy = YoungDaly(save_seconds=5.0, mtbf_seconds=86_400.0, minimum=1, maximum=1e6)
    assert policy.cost() == 5.0
    for seconds in (1000.0, 20.0, 20.0, 20.0, 20.0, 20.0):  # the first falls out of the window
        policy.observe_save(seconds)
    policy.observe_save(-1.0)  # not a duration: ignored
    assert policy.cost() == 20.0
    assert policy.interval() == pytest.approx(daly_interval(20.0, 86_400.0))


def test_the_observed_mtbf_wins_over_the_constructor_then_the_variable_then_the_default(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert YoungDaly().mtbf() == DEFAULT_MTBF
    monkeypatch.setenv("VERTEXRT_MTBF", "7200")
    assert YoungDaly().mtbf() == 7200.0
    policy = YoungDaly(save_seconds=30.0, mtbf_seconds=3600.0, minimum=1)
    assert policy.mtbf() == 3600.0
    policy.observe_mtbf(1800.0, failures=2)
    assert policy.mtbf() == 1800.0
    assert policy.interval() == pytest.approx(daly_interval(30.0, 1800.0))
    policy.observe_mtbf(900.0, failures=0)  # no failure: nothing observed
    assert policy.mtbf() == 1800.0


@pytest.mark.parametrize(
    ("make", "named"),
    [
        (lambda: YoungDaly(save_seconds=0), r"YoungDaly\(save_seconds=0\)"),
        (lambda: YoungDaly(mtbf_seconds=math.inf), r"YoungDaly\(mtbf_seconds=inf\)"),
        (lambda: YoungDaly(minimum=-1), r"YoungDaly\(minimum=-1\)"),
        (lambda: YoungDaly(minimum=600, maximum=60), r"maximum must be >= minimum"),
        (lambda: YoungDaly(save_seconds="30"), r"YoungDaly\(save_seconds='30'\)"),  # type: ignore[arg-type]
    ],
)
def test_bad_values_are_config_errors_naming_them(make: object, named: str) -> None:
    with pytest.raises(ConfigError, match=named):
        make()  # type: ignore[operator]


@pytest.mark.parametrize("raw", ["soon", "0", "-5", "inf"])
def test_a_bad_mtbf_variable_is_a_config_error_at_construction(
    monkeypatch: pytest.MonkeyPatch, raw: str
) -> None:
    monkeypatch.setenv("VERTEXRT_MTBF", raw)
    with pytest.raises(ConfigError, match="VERTEXRT_MTBF="):
        YoungDaly()


def test_the_interval_is_logged_once_and_again_only_when_it_moves_materially(
    caplog: pytest.LogCaptureFixture,
) -> None:
    policy = YoungDaly(save_seconds=60.0, mtbf_seconds=86_400.0, minimum=1, maximum=1e6)
    with caplog.at_level(logging.INFO, logger="vertexrt.checkpoint.policies"):
        for _ in range(3):
            asked(policy, seconds_since_save=1)
        policy.observe_save(61.0)  # ~1% longer: the same interval as far as the log goes
        asked(policy, seconds_since_save=1)
        policy.observe_mtbf(3600.0, failures=2)  # ~5x shorter
        asked(policy, seconds_since_save=1)
    lines = [r.getMessage() for r in caplog.records if "durable checkpoint interval" in r.getMessage()]
    assert len(lines) == 2, lines
    assert "durable checkpoint interval 3180 s" in lines[0] and "mtbf_seconds" in lines[0]
    assert "over 2 failure(s) in the attempt log" in lines[1]


def test_a_combined_policy_reaches_its_young_daly_part() -> None:
    learner = YoungDaly(mtbf_seconds=86_400.0, minimum=1)
    combined = EveryNSteps(1000) | learner
    observe_save_cost(combined, 12.0)
    assert learner.cost() == 12.0
    assert combined.should_save(1000, LastSave(step=None, time=None, now=1.0, start_time=0.0))


def test_the_manager_tells_the_policy_the_cost_of_each_durable_save(tmp_path: Path) -> None:
    policy = YoungDaly(mtbf_seconds=86_400.0)
    with CheckpointManager(str(tmp_path / "ckpt"), save_policy=policy, async_save=True) as manager:
        assert policy.cost() is None
        assert manager.save(1, {"w": list(range(100))}, force=True)
        manager.wait()
        first = policy.cost()
        assert first is not None and first > 0
        assert manager.save(2, {"w": list(range(100))}, force=True)
        manager.wait()
    assert policy.cost() is not None

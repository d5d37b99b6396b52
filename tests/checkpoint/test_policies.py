"""Save and keep policies, alone and combined."""

from __future__ import annotations

import pytest

from vertexrt.checkpoint import (
    CheckpointInfo,
    EveryNSeconds,
    EveryNSteps,
    KeepBest,
    KeepEveryNSteps,
    KeepLast,
    LastSave,
)
from vertexrt.errors import ConfigError


def _last(step=None, time=None, now=100.0, start=0.0):
    return LastSave(step=step, time=time, now=now, start_time=start)


def test_every_n_steps_and_seconds_combine():
    policy = EveryNSteps(10) | EveryNSeconds(30)
    assert policy.should_save(20, _last(step=10, time=95.0))
    assert not policy.should_save(21, _last(step=20, time=95.0))
    assert policy.should_save(21, _last(step=20, time=60.0))
    assert not EveryNSeconds(30).should_save(5, _last(now=10.0, start=0.0))  # counts from the start
    assert not EveryNSteps(10).should_save(10, _last(step=10))  # never the same step twice


def test_keep_policies():
    infos = [CheckpointInfo(s, float(s), {"loss": 1.0 / s} if s != 3 else {}) for s in range(1, 7)]
    assert KeepLast(2).keep(infos) == [False, False, False, False, True, True]
    assert KeepEveryNSteps(3).keep(infos) == [False, False, True, False, False, True]
    assert KeepBest("loss", "max", n=2).keep(infos) == [True, True, False, False, False, False]
    combined = KeepLast(1) | KeepBest("loss", "min") | KeepEveryNSteps(4)
    assert combined.keep(infos) == [False, False, False, True, False, True]


@pytest.mark.parametrize(
    "make",
    [lambda: EveryNSteps(0), lambda: EveryNSeconds(-1), lambda: KeepLast(0), lambda: KeepBest("x", "up")],
)
def test_bad_arguments_are_config_errors(make):
    with pytest.raises(ConfigError):
        make()

"""Progress lines: rates, ETA, metrics shown, and nothing printed on non-chief ranks."""

from __future__ import annotations

import logging
import warnings

import pytest
import torch

from vertexrt.runtime.progress import Progress, format_eta


def test_format_eta() -> None:
    assert format_eta(3725.2) == "1:02:05"
    assert format_eta(-3) == "0:00:00"


def test_line_has_step_total_rates_eta_and_metrics() -> None:
    progress = Progress(total_steps=100, start_step=10, interval=3600, bar=False)
    for step in range(11, 21):
        progress.update(step, samples=32, metrics={"loss": torch.tensor(0.25), "tag": "x"})
    line = progress.line()
    assert line.startswith("step 20/100 (20%) ")
    assert "steps/s" in line and "samples/s" in line and "ETA " in line
    assert line.endswith("loss=0.25")
    rates = progress.rates()
    assert rates["samples_per_s"] == pytest.approx(rates["steps_per_s"] * 32)


def test_unknown_total_has_no_eta() -> None:
    progress = Progress(interval=3600, bar=False)
    progress.update(1)
    assert "ETA" not in progress.line()
    assert progress.rates()["eta_s"] == -1.0
    progress.set_total(4)
    assert progress.line().startswith("step 1/4 (25%)")


def test_logs_every_interval_and_at_close(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="vertexrt.runtime.progress")
    progress = Progress(total_steps=3, interval=0.0, bar=False)
    for step in (1, 2, 3):
        progress.update(step)
    progress.close()
    lines = [r.getMessage() for r in caplog.records]
    assert [line.split()[1] for line in lines] == ["1/3", "2/3", "3/3", "3/3"]


def test_disabled_progress_prints_nothing(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="vertexrt.runtime.progress")
    progress = Progress(total_steps=3, interval=0.0, bar=True, enabled=False)
    progress.update(1)
    progress.close()
    assert caplog.records == []


def test_bar_counts_steps(capsys: pytest.CaptureFixture[str]) -> None:
    progress = Progress(total_steps=5, start_step=2, interval=0.0, bar=True)
    for step in (3, 4, 5):
        progress.update(step, samples=8, metrics={"loss": 1.5})
    assert progress._bar.n == 5
    progress.close()
    assert "5/5" in capsys.readouterr().err


def test_a_loss_tensor_that_requires_grad_is_shown_without_a_warning() -> None:
    # train_step usually returns the loss itself; float() on it warns "Converting a tensor with
    # requires_grad=True to a scalar" at every progress line unless it is detached first.
    loss = (torch.ones(3, requires_grad=True) * 2).sum()
    p = Progress(total_steps=10, interval=3600.0)
    p.update(1, 4, {"loss": loss})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert "loss=6" in p.line()

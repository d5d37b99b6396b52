"""``fast=`` at the entry points: ``@vertexrt.main(fast=...)`` and ``Trainer(fast=...)`` give the default
``ctx.checkpoints`` a fast tier (winning over ``VERTEXRT_FAST_CHECKPOINT_EVERY``), and a Trainer that crashed
resumes from its newest fast step with the weights of an uninterrupted run.

A crash is an exception from ``train_step`` followed by what ``@main`` does on a failure (``ctx.close(drain=
False)``); the next run is a new context and a new manager on the same directories, as a restarted replica.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from vertexrt.checkpoint import CheckpointManager, EveryNSteps, FastTier
from vertexrt.errors import ConfigError
from vertexrt.runtime import Context, Trainer, main

TOTAL = 8


class Line(Trainer):
    """A linear model over fixed batches; raises at ``crash_at`` (steps done), records where it started."""

    def __init__(self, ctx: Context, *, crash_at: int | None = None, **kwargs: Any) -> None:
        super().__init__(
            ctx, max_steps=TOTAL, preflight=False, progress_bar=False, tensorboard=False, **kwargs
        )
        self.crash_at = crash_at
        self.started_at: int | None = None

    def setup(self) -> None:
        torch.manual_seed(0)
        self.model = torch.nn.Linear(2, 1)
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.01)
        self.train_data = [torch.full((4, 2), float(i % 3)) for i in range(TOTAL)]

    def train_step(self, x: torch.Tensor) -> dict[str, float]:
        if self.started_at is None:
            self.started_at = self.step
        if self.step == self.crash_at:
            raise RuntimeError(f"crash after step {self.step}")
        loss = (self.model(x) - 1.0).pow(2).mean()
        self.optimizer.zero_grad()
        loss.backward()
        self.optimizer.step()
        return {}

    def weights(self) -> list[float]:
        return [*self.model.weight.flatten().tolist(), *self.model.bias.tolist()]


def fast_steps(fast_directory: str | None) -> list[int]:
    """The committed fast steps of rank 0's own state under a manager's fast directory."""
    assert fast_directory is not None
    own = Path(fast_directory) / "rank_0" / "own"
    return sorted(int(p.name.split("_")[1]) for p in own.glob("step_*"))


@pytest.fixture
def fresh(runtime_env: Any, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """No fast-tier variable; the durable directory under tmp_path/run; returns the local disk's root."""
    for name in ("VERTEXRT_FAST_CHECKPOINT_EVERY", "VERTEXRT_FAST_CHECKPOINT_PEERS"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.delenv("VERTEXRT_LOCAL_CHECKPOINT_DIR", raising=False)
    monkeypatch.setenv("VERTEXRT_LOCAL_DIR", str(tmp_path / "run"))
    return tmp_path / "local-disk"


def fit(trainer: Line) -> None:
    """``trainer.fit()``, then what ``@main`` does when the function returns or raises."""
    try:
        trainer.fit()
    finally:
        trainer.ctx.close(drain=False)


def test_a_trainer_with_fast_writes_fast_steps_and_resumes_from_the_newest_after_a_crash(
    fresh: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    tier = FastTier(every=EveryNSteps(2), peers=0, directory=str(fresh))
    crashed = Line(Context.create(), crash_at=5, fast=tier)
    with pytest.raises(RuntimeError, match="crash after step 5"):
        fit(crashed)
    assert fast_steps(crashed.checkpoints.fast_directory) == [2, 4]  # the newest two kept
    assert crashed.checkpoints.all_steps() == []  # the durable tier (every 10 minutes): nothing yet

    resumed = Line(Context.create(), fast=tier)
    fit(resumed)
    assert resumed.started_at == 4  # fast step 4, not a fresh start

    monkeypatch.setenv("VERTEXRT_LOCAL_DIR", str(tmp_path / "reference"))
    uninterrupted = Line(Context.create())
    fit(uninterrupted)
    assert uninterrupted.started_at == 0
    assert resumed.weights() == uninterrupted.weights()


def test_main_fast_reaches_a_trainer_and_a_restart_resumes_from_the_fast_step(fresh: Path) -> None:
    tier = FastTier(every=EveryNSteps(2), peers=0, directory=str(fresh))
    runs: list[Line] = []

    @main(fast=tier, preflight=False)
    def train(ctx: Context) -> None:
        assert ctx.fast == tier
        runs.append(Line(ctx, crash_at=None if runs else 5))
        runs[-1].fit()

    with pytest.raises(RuntimeError, match="crash after step 5"):
        train([])
    train([])
    assert [run.started_at for run in runs] == [0, 4]
    assert runs[1].step == TOTAL


def test_main_fast_wins_over_the_environment_variable(fresh: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VERTEXRT_FAST_CHECKPOINT_EVERY", "3")

    def saves(ctx: Context) -> list[int]:
        for step in range(1, 6):
            ctx.checkpoints.save(step, {"step": step})
        ctx.checkpoints.wait()
        return fast_steps(ctx.checkpoints.fast_directory)

    explicit = main(fast=FastTier(every=EveryNSteps(2), peers=0, directory=str(fresh)), preflight=False)
    assert explicit(saves)([]) == [2, 4]
    monkeypatch.setenv("VERTEXRT_LOCAL_CHECKPOINT_DIR", str(fresh / "from-env"))
    assert main(preflight=False)(saves)([]) == [3]  # no fast=: the variable's tier


@pytest.mark.parametrize(
    ("make", "named"),
    [
        (lambda: main(fast=EveryNSteps(5)), r"@vertexrt\.main\(fast=\.\.\.\): got EveryNSteps"),
        (lambda: Line(Context.create(), fast=10), r"Trainer\(fast=\.\.\.\): got 10"),  # type: ignore[arg-type]
        (lambda: Context.create(fast="5"), r"Context\.create\(fast=\.\.\.\): got '5'"),  # type: ignore[arg-type]
    ],
    ids=["main", "trainer", "context"],
)
def test_a_fast_option_that_is_not_a_fast_tier_is_a_config_error_naming_it(
    fresh: Path, make: Any, named: str
) -> None:
    with pytest.raises(ConfigError, match=named):
        make()


def test_trainer_checkpoints_and_fast_together_is_a_config_error(fresh: Path, tmp_path: Path) -> None:
    with (
        CheckpointManager(str(tmp_path / "mine")) as manager,
        pytest.raises(ConfigError, match=r"Trainer\(checkpoints=\.\.\., fast=\.\.\.\).*CheckpointManager"),
    ):
        Line(Context.create(), checkpoints=manager, fast=FastTier(peers=0))


def test_trainer_fast_after_the_default_manager_exists_or_against_main_s_tier_is_a_config_error(
    fresh: Path,
) -> None:
    ctx = Context.create()
    assert ctx.checkpoints.fast_directory is None  # made, without a fast tier
    with pytest.raises(ConfigError, match=r"Trainer\(fast=\.\.\.\): ctx\.checkpoints .* exists already"):
        Line(ctx, fast=FastTier(peers=0, directory=str(fresh)))
    ctx.close()

    chosen = FastTier(every=EveryNSteps(2), peers=0, directory=str(fresh))
    ctx = Context.create(fast=chosen)
    Line(ctx, fast=FastTier(every=EveryNSteps(2), peers=0, directory=str(fresh)))  # the same tier: fine
    with pytest.raises(ConfigError, match=r"already has the fast tier"):
        Line(ctx, fast=FastTier(every=EveryNSteps(3), peers=0, directory=str(fresh)))

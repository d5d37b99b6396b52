"""Context: the cluster position, output dirs and checkpoint manager a training function gets."""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

from vertexrt.runtime import Context


def test_a_vertex_worker_replica(vertex_env: Any, tmp_path: Path) -> None:
    vertex_env(base_output_dir=str(tmp_path / "base"), workers=2, task=("workerpool1", 1))
    ctx = Context.create()
    assert (ctx.rank, ctx.world_size, ctx.is_chief, ctx.replica) == (2, 3, False, "workerpool1-1")
    assert ctx.env.checkpoint_dir == str(tmp_path / "base" / "checkpoints")
    assert ctx.checkpoints.directory == ctx.env.checkpoint_dir
    assert (ctx.checkpoints.rank, ctx.checkpoints.world_size) == (2, 3)
    assert not ctx.metrics.is_chief


def test_should_stop_follows_sigterm_once_the_handler_is_installed(runtime_env: Any) -> None:
    before = signal.getsignal(signal.SIGTERM)
    ctx = Context.create()
    assert not ctx.should_stop()
    ctx.install_preemption_handler()
    try:
        assert not ctx.should_stop()
        os.kill(os.getpid(), signal.SIGTERM)
        assert ctx.should_stop() and ctx.preempted
    finally:
        ctx.close()
    assert signal.getsignal(signal.SIGTERM) is before


def test_metrics_reporter_keeps_the_latest_and_writes_hypertune(runtime_env: Path) -> None:
    ctx = Context.create()
    ctx.metrics.report({"accuracy": 0.5}, step=1)
    ctx.metrics.report({"accuracy": 0.75, "loss": 0.2}, step=2)
    assert ctx.metrics.latest == {"accuracy": 0.75, "loss": 0.2}
    assert runtime_env.read_text().count('"accuracy"') == 2

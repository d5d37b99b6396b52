"""Context: the cluster position, output dirs and checkpoint manager a training function gets."""

from __future__ import annotations

import os
import signal
import socket
from pathlib import Path
from typing import Any

import pytest
from rank_exit import exits_hard

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


@exits_hard
def _hand_made_group_worker(rank: int, port: int, out: str) -> None:
    import torch.distributed as dist

    for name in ("LOCAL_RANK", "LOCAL_WORLD_SIZE", "RANK", "WORLD_SIZE", "CLUSTER_SPEC", "TF_CONFIG"):
        os.environ.pop(name, None)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        ctx = Context.create(rank=rank, world_size=2)  # device "cpu"
        Path(out, f"rank{rank}").write_text(f"{ctx.rank} {ctx.world_size} {ctx.local_rank}")
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_a_hand_made_cpu_process_group_needs_no_local_rank(tmp_path: Path) -> None:
    """Two processes join a gloo group by hand (no LOCAL_RANK, no cluster variables): on CPU the local rank
    picks no GPU, and on one machine it is the rank."""
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(_hand_made_group_worker, args=(port, str(tmp_path)), nprocs=2, start_method="spawn")
    assert [(tmp_path / f"rank{r}").read_text() for r in (0, 1)] == ["0 2 0", "1 2 1"]

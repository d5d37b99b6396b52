"""A user's training script, type-checked with ``mypy --strict`` by ``make lint``: every public name the
README uses must be explicitly exported (a literal ``__all__`` or ``import X as X``).

It is never run; only its types are checked.
"""

from __future__ import annotations

import vertexrt
import vertexrt.data
import vertexrt.distributed
from vertexrt import Context, Trainer, main
from vertexrt.checkpoint import CheckpointManager, EveryNSteps, FastTier, KeepLast, YoungDaly, rng_state
from vertexrt.data import Dataset, open_dataset
from vertexrt.distributed import Cluster, WorldInfo, cluster, world_info
from vertexrt.errors import (
    CheckpointCorruptError,
    CheckpointError,
    ClusterSpecError,
    ClusterSpecWarning,
    ConfigError,
    VertexrtError,
    VertexrtWarning,
)


def where_am_i() -> tuple[int, int, bool, str]:
    here: Cluster = cluster()
    world: WorldInfo = world_info()
    return world.rank, here.world_size, world.is_chief, here.replica


def checkpoints(directory: str) -> int | None:
    manager = CheckpointManager(directory, save_policy=EveryNSteps(100), keep_policy=KeepLast(3))
    state = {"step": 0, "rng": rng_state()}
    try:
        manager.restore(target=state)
    except CheckpointCorruptError as err:
        print(err.file)
    except CheckpointError:
        pass
    return manager.latest_step()


def data() -> Dataset:
    return open_dataset("gs://bucket/train-*.jsonl")


def environment() -> str:
    env: vertexrt.Environment = vertexrt.environment()
    try:
        return vertexrt.project_id()
    except (ConfigError, ClusterSpecError, VertexrtError):
        return env.model_dir
    finally:
        print(vertexrt.doctor.contract_warnings(), vertexrt.distributed.cluster().rank)
        print(issubclass(ClusterSpecWarning, VertexrtWarning), vertexrt.ClusterSpecWarning)
        print(vertexrt.CheckpointCorruptError, vertexrt.data.open_dataset, vertexrt.errors.DataError)


@main(framework="torch", fast=FastTier(every=EveryNSteps(10), peers=1))
def train(ctx: Context) -> None:
    print(ctx.rank, ctx.is_chief, ctx.replica, Trainer(ctx, fast=ctx.fast))
    ctx.checkpoints = CheckpointManager(save_policy=YoungDaly(mtbf_seconds=86_400.0) | EveryNSteps(10_000))

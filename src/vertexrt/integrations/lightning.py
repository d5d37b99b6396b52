"""Lightning (``lightning.pytorch.Trainer`` and ``lightning.Fabric``) on Vertex AI through vertexrt.

- :class:`VertexEnvironment`: ranks, world size and the rendezvous from vertexrt's cluster model
  (``CLUSTER_SPEC``, torchrun, ``local-run``), one process per replica or Lightning's own one per device.
- :class:`VertexCheckpointIO`: ``Trainer``/``Fabric`` checkpoints saved by a
  :class:`~vertexrt.checkpoint.CheckpointManager` (atomic commit on ``gs://`` and ``/gcs/``, CRC, async,
  retention by ``keep_policy``).
- :class:`VertexCallback`: saves and exits 143 on a preemption notice (ranks agree first), reports the
  monitored metric to hyperparameter tuning, and names the newest valid checkpoint to resume from.

Example:
    >>> vertex = VertexCallback(monitor="val_loss")
    >>> trainer = lightning.pytorch.Trainer(plugins=vertex.plugins(), callbacks=[vertex], strategy="ddp")
    >>> trainer.fit(model, datamodule, ckpt_path=vertex.ckpt_path())   # None on a fresh start
"""

from __future__ import annotations

import logging
import os
import re
from pathlib import PurePosixPath
from typing import Any

import lightning.pytorch as pl

from vertexrt import audit
from vertexrt.checkpoint.resuming import log_resuming
from vertexrt.distributed.cluster_model import Cluster
from vertexrt.distributed.torch import destroy_at_exit
from vertexrt.errors import ConfigError
from vertexrt.integrations._lightning_bases import Callback, CheckpointIO, ClusterEnvironment

log = logging.getLogger(__name__)

__all__ = ["VertexCallback", "VertexCheckpointIO", "VertexEnvironment"]

#: The step number in a checkpoint path: ``step_12`` (vertexrt) or ``epoch=0-step=12.ckpt`` (Lightning).
_STEP = re.compile(r"step[_=-]?(\d+)")


class VertexEnvironment(ClusterEnvironment):
    """Lightning's view of a Vertex job, read from :func:`vertexrt.distributed.cluster` at each call.

    With one process per replica (``devices=1``) or an external launcher (torchrun,
    :func:`vertexrt.distributed.spawn`, ``local-run --processes-per-node``) the ranks are the cluster's.
    With ``devices=K > 1`` Lightning starts the K processes of each replica itself; this environment then
    exports torchrun's variables (``LOCAL_WORLD_SIZE``, ``GROUP_RANK``, ``RANK``...) so that the rest of
    vertexrt sees the same ranks as Lightning.

    Example:
        >>> trainer = Trainer(plugins=[VertexEnvironment()], num_nodes=cluster().num_nodes, devices="auto")
    """

    def __init__(self) -> None:
        super().__init__()
        destroy_at_exit()  # Lightning creates the process group; a clean exit tears it down first
        self._devices: int | None = None
        self._world_size: int | None = None
        self._rank: int | None = None

    @property
    def creates_processes_externally(self) -> bool:
        return "LOCAL_RANK" in os.environ or self._devices == 1

    @property
    def main_address(self) -> str:
        c = self._cluster()
        if c.node_rank == 0 or c.rendezvous_address is None:
            return "127.0.0.1"  # the chief's own service name may not resolve early in the job
        return c.rendezvous_address.rpartition(":")[0].strip("[]")

    @property
    def main_port(self) -> int:
        c = self._cluster()
        if c.rendezvous_address is not None:
            return int(c.rendezvous_address.rpartition(":")[2])
        if "MASTER_PORT" not in os.environ:  # one replica: a port every process of this node agrees on
            from vertexrt._net import free_port

            os.environ["MASTER_PORT"] = str(free_port())
        return int(os.environ["MASTER_PORT"])

    @staticmethod
    def detect() -> bool:
        """True inside a Vertex AI custom job (every replica gets ``CLUSTER_SPEC``)."""
        return bool(os.environ.get("CLUSTER_SPEC", "").strip())

    def world_size(self) -> int:
        return self._world_size if self._world_size is not None else self._cluster().world_size

    def set_world_size(self, size: int) -> None:
        self._world_size = size  # num_nodes x devices; validate_settings checks it against the cluster

    def global_rank(self) -> int:
        return self._rank if self._rank is not None else self._cluster().rank

    def set_global_rank(self, rank: int) -> None:
        self._rank = rank

    def local_rank(self) -> int:
        return int(os.environ.get("LOCAL_RANK", "0"))

    def node_rank(self) -> int:
        return self._cluster().node_rank

    def validate_settings(self, num_devices: int, num_nodes: int) -> None:
        external = self.creates_processes_externally
        c = self._cluster()
        if num_nodes != c.num_nodes:
            raise ConfigError(
                f"Trainer(num_nodes={num_nodes}) but {c.source} describes {c.num_nodes} training replicas; "
                "pass num_nodes=vertexrt.distributed.cluster().num_nodes"
            )
        if external and "LOCAL_RANK" in os.environ and num_devices != c.local_world_size:
            raise ConfigError(
                f"Trainer(devices={num_devices}) but the launcher started {c.local_world_size} processes on "
                "this replica (LOCAL_WORLD_SIZE); pass devices=1 per process"
            )
        self._devices = num_devices
        if not external and num_devices > 1:  # Lightning starts the processes: describe them as torchrun does
            os.environ.update(
                LOCAL_WORLD_SIZE=str(num_devices),
                GROUP_RANK=str(c.node_rank),
                GROUP_WORLD_SIZE=str(c.num_nodes),
            )

    def _cluster(self) -> Cluster:
        from vertexrt.distributed import cluster

        env = os.environ
        if "LOCAL_RANK" in env and "GROUP_RANK" in env and "LOCAL_WORLD_SIZE" in env and "RANK" not in env:
            # a process Lightning started: its global rank and process-level WORLD_SIZE, as torchrun has
            per_node, nodes = int(env["LOCAL_WORLD_SIZE"]), int(env.get("GROUP_WORLD_SIZE", "1"))
            env["RANK"] = str(int(env["GROUP_RANK"]) * per_node + int(env["LOCAL_RANK"]))
            env["WORLD_SIZE"] = str(per_node * nodes)
        return cluster()


class VertexCheckpointIO(CheckpointIO):
    """Lightning checkpoints through a :class:`~vertexrt.checkpoint.CheckpointManager` in ``directory``.

    A checkpoint is saved as step ``checkpoint["global_step"]`` (else the ``step=N`` in its file name);
    saving a step again replaces it atomically. ``load_checkpoint(path)`` reads the step named in ``path``
    (``.../step_12`` or ``epoch=0-step=12.ckpt``). Retention is ``keep_policy``'s (default ``KeepLast(3)``):
    ``remove_checkpoint`` (Lightning's ``save_top_k``) deletes nothing.

    Args:
        directory: where the steps live (local, ``/gcs/...`` or ``gs://...``); default
            ``vertexrt.env.environment().checkpoint_dir`` (``AIP_CHECKPOINT_DIR``).
        keep_policy: which committed steps survive.
        async_save: write in the background (Lightning's loop continues while the bytes upload).

    Example:
        >>> io = VertexCheckpointIO("gs://bucket/run/ckpt")
        >>> trainer = Trainer(plugins=[io])            # or Fabric(plugins=[io]); fabric.save(path, state)
    """

    def __init__(self, directory: str | None = None, *, keep_policy: Any = None, async_save: bool = True):
        if directory is None:
            from vertexrt.env import environment

            directory = environment().checkpoint_dir
        self.directory = str(directory).rstrip("/")
        self.keep_policy = keep_policy
        self.async_save = async_save
        self._manager: Any = None

    @property
    def manager(self) -> Any:
        """The :class:`~vertexrt.checkpoint.CheckpointManager`, made on first use (in a training process)."""
        if self._manager is None:
            from vertexrt.checkpoint import CheckpointManager

            self._manager = CheckpointManager(
                self.directory, keep_policy=self.keep_policy, async_save=self.async_save, allow_pickle=True
            )
        return self._manager

    def path_for(self, step: int) -> str:
        """The path that names ``step`` for ``Trainer.fit(ckpt_path=...)`` / ``load_checkpoint``."""
        return f"{self.directory}/step_{step}"

    def latest_path(self) -> str | None:
        """The newest committed step whose files are all present, as a path; None on a fresh start."""
        step = self.manager.latest_step()
        return None if step is None else log_resuming(self.directory, step, result=self.path_for(step))

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any = None) -> None:
        step = checkpoint.get("global_step")
        if not isinstance(step, int):
            step = _step_in(path)
        manager = self.manager
        manager.wait()  # a save of this step may be in flight (save_last=True saves each step twice)
        manager.save(step, {"lightning": checkpoint, "name": PurePosixPath(str(path)).name}, force=True,
                     overwrite=step in manager.all_steps())  # fmt: skip

    def load_checkpoint(self, path: Any, map_location: Any = None, weights_only: bool | None = None) -> Any:
        restored = self.manager.restore(step=_step_in(path))
        return restored["lightning"]

    def remove_checkpoint(self, path: Any) -> None:
        log.debug("not removing %s: retention in %s is the keep_policy's", path, self.directory)

    def wait(self) -> None:
        """Block until the save in flight is committed (re-raises its error)."""
        if self._manager is not None:
            self._manager.wait()

    def teardown(self) -> None:
        self.wait()


def _step_in(path: Any) -> int:
    found = _STEP.findall(PurePosixPath(str(path)).name)
    if not found:
        raise ConfigError(
            f"checkpoint path {path!r} names no step: use VertexCheckpointIO.path_for(step) (.../step_<N>) "
            "or a Lightning file name with step=<N>, or save a checkpoint dict with an int 'global_step'"
        )
    return int(found[-1])


class VertexCallback(Callback):
    """Preemption, hyperparameter tuning and resumption for ``lightning.pytorch.Trainer`` on Vertex.

    - On SIGTERM (through :func:`vertexrt.preemption.signals.preemption_signal`, the one owner: Lightning's
      own SIGTERM handler, which calls a collective from inside the handler, is not installed), every rank
      agrees at a batch end (:class:`~vertexrt.preemption.vote.StopVote`), saves one checkpoint through
      :class:`VertexCheckpointIO`, waits for the commit and exits with status 143.
    - After each validation, rank 0 reports ``trainer.callback_metrics[monitor]`` to hypertune.
    - :meth:`ckpt_path` is the newest valid checkpoint, for ``trainer.fit(ckpt_path=...)``.
    - When training starts, a WARNING names a training loader that would not resume exactly (Lightning
      restores only a loader's own state): use :func:`vertexrt.data.resumable_loader` for a map-style
      dataset, ``vertexrt.data.DataLoader`` over a vertexrt reader with ``equalize`` for streaming data.

    Example:
        >>> vertex = VertexCallback(monitor="val_accuracy")
        >>> trainer = Trainer(plugins=vertex.plugins(), callbacks=[vertex])
        >>> trainer.fit(model, ckpt_path=vertex.ckpt_path())
    """

    def __init__(self, checkpoint_io: VertexCheckpointIO | None = None, *, monitor: str | None = None):
        self.checkpoint_io = checkpoint_io if checkpoint_io is not None else VertexCheckpointIO()
        self.monitor = monitor
        self._preemption: Any = None  # a vertexrt.preemption.vote.PreemptionAgreement while training

    def plugins(self) -> list[Any]:
        """``[VertexEnvironment(), self.checkpoint_io]`` for ``Trainer(plugins=...)``."""
        return [VertexEnvironment(), self.checkpoint_io]

    def ckpt_path(self) -> str | None:
        """The newest valid checkpoint to resume from, or None on a fresh start."""
        return self.checkpoint_io.latest_path()

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        if trainer.strategy.checkpoint_io is not self.checkpoint_io:
            raise ConfigError(
                "VertexCallback: the Trainer saves through another CheckpointIO; pass "
                "Trainer(plugins=callback.plugins(), ...) so the preemption save goes through vertexrt"
            )
        from vertexrt.preemption.vote import PreemptionAgreement

        connector = trainer._signal_connector

        def _no_sigterm_handler() -> None:  # vertexrt owns SIGTERM for this fit
            connector.received_sigterm = False
            connector._original_handlers = {}

        connector.register_signal_handlers = _no_sigterm_handler  # type: ignore[method-assign]
        self._preemption = PreemptionAgreement()

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        from vertexrt.data.resume_check import warn_if_inexact

        loaders = trainer.train_dataloader
        if isinstance(loaders, dict):
            loaders = list(loaders.values())
        for loader in loaders if isinstance(loaders, (list, tuple)) else [loaders]:
            warn_if_inexact(loader, "VertexCallback", restores_state_only=True)

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        audit.step(trainer.global_step)  # `local-run --chaos` counts steps and places faults here
        if self._preemption is None or not self._preemption():
            return
        from vertexrt.preemption.signals import PREEMPTED_EXIT_CODE

        path = self.checkpoint_io.path_for(trainer.global_step)
        log.warning("preemption notice: saving %s, then exiting %d", path, PREEMPTED_EXIT_CODE)
        trainer.save_checkpoint(path, weights_only=False)  # the whole state; unset, Lightning logs each save
        self.checkpoint_io.wait()
        self._release()
        raise SystemExit(PREEMPTED_EXIT_CODE)

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        audit.event("epoch_end", step=trainer.global_step, epoch=trainer.current_epoch)

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.monitor is None or trainer.sanity_checking or not trainer.is_global_zero:
            return
        value = trainer.callback_metrics.get(self.monitor)
        if value is None:
            raise ConfigError(
                f"VertexCallback(monitor={self.monitor!r}): the LightningModule logs no such metric; "
                f"logged: {sorted(trainer.callback_metrics)}"
            )
        from vertexrt import hypertune

        hypertune.report(self.monitor, float(value), step=trainer.global_step)

    def on_exception(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException
    ) -> None:
        self._release()

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._release()

    def _release(self) -> None:
        preemption, self._preemption = self._preemption, None
        if preemption is not None:
            preemption.close()

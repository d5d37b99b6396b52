"""``Context``: what a training function needs to know about where and how it runs.

``@vertexrt.main`` builds one and passes it in; ``Context.create()`` builds one without the decorator
(e.g. in a notebook or a test).

Example:
    >>> ctx = Context.create()
    >>> ctx.is_chief, ctx.world_size
    (True, 1)
    >>> ctx.checkpoints.directory          # AIP_CHECKPOINT_DIR, or the local fallback  # doctest: +SKIP
    >>> if ctx.should_stop():              # a preemption notice arrived (agreed across ranks)
    ...     pass
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from vertexrt.runtime.metrics import MetricsReporter
from vertexrt.runtime.vote import StopVote

if TYPE_CHECKING:
    from vertexrt.checkpoint import CheckpointManager, PreemptionNotice
    from vertexrt.distributed import Cluster
    from vertexrt.env import Environment


@dataclass
class Context:
    """The environment, cluster position, device, checkpoint manager and metrics of this process.

    Attributes:
        env: the Vertex runtime contract (output dirs, data URIs, job and trial ids).
        cluster: this process's place in the job (role, index, ranks).
        framework: ``"torch"``, ``"tf"`` or ``None``.
        device: a ``torch.device`` for torch, ``"cpu"`` otherwise.
        rank, world_size, local_rank: of this training process (torch.distributed's when it is up).
        args: the parsed arguments when ``@main`` was given a parser, else ``None``.
        strategy: the ``tf.distribute.Strategy`` for ``framework="tf"``, else ``None``.
        metrics: reports metrics to logs and hypertune (chief only).
    """

    env: Environment
    cluster: Cluster
    framework: str | None = None
    device: Any = "cpu"
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    args: Any = None
    strategy: Any = None
    metrics: MetricsReporter = field(default_factory=lambda: MetricsReporter(is_chief=True))
    _checkpoints: CheckpointManager | None = field(default=None, repr=False)
    _notice: PreemptionNotice | None = field(default=None, repr=False)
    _vote: StopVote = field(default_factory=StopVote, repr=False)
    _preempted: bool = field(default=False, repr=False)

    @classmethod
    def create(
        cls,
        framework: str | None = None,
        *,
        device: Any = "cpu",
        rank: int | None = None,
        world_size: int | None = None,
        local_rank: int | None = None,
        args: Any = None,
        strategy: Any = None,
    ) -> Context:
        """Read the environment and the cluster now; ranks default to the cluster's."""
        from vertexrt.distributed import cluster as read_cluster
        from vertexrt.env import environment

        where = read_cluster()
        rank = where.rank if rank is None else rank
        return cls(
            env=environment(),
            cluster=where,
            framework=framework,
            device=device,
            rank=rank,
            world_size=where.world_size if world_size is None else world_size,
            local_rank=where.local_rank if local_rank is None else local_rank,
            args=args,
            strategy=strategy,
            metrics=MetricsReporter(is_chief=rank == 0),
        )

    @property
    def is_chief(self) -> bool:
        """True on the one process that exports, reports metrics and logs INFO (global rank 0)."""
        return self.rank == 0

    @property
    def replica(self) -> str:
        """The Vertex replica name, e.g. ``workerpool0-0`` (the role, e.g. ``chief-0``, without pools)."""
        pool = self.cluster.pool(self.cluster.role)
        return f"{pool.name if pool else self.cluster.role}-{self.cluster.task_index}"

    @property
    def checkpoints(self) -> CheckpointManager:
        """The checkpoint manager on ``env.checkpoint_dir`` (``AIP_CHECKPOINT_DIR``), created on first use.

        It saves every 10 minutes (``EveryNSeconds(600)``) and keeps the last 3; assign another manager to
        change the policies, e.g. ``ctx.checkpoints = CheckpointManager(save_policy=EveryNSteps(500))``.
        """
        if self._checkpoints is None:
            from vertexrt.checkpoint import CheckpointManager, EveryNSeconds

            self._checkpoints = CheckpointManager(
                self.env.checkpoint_dir,
                save_policy=EveryNSeconds(600),
                rank=self.rank,
                world_size=self.world_size,
            )
        return self._checkpoints

    @checkpoints.setter
    def checkpoints(self, manager: CheckpointManager) -> None:
        self._checkpoints = manager

    @property
    def preempted(self) -> bool:
        """True once ``should_stop()`` has returned True."""
        return self._preempted

    def install_preemption_handler(self) -> bool:
        """Make SIGTERM (Vertex's preemption notice) set a flag instead of killing the process.

        Returns False when it was already installed. Call it from the main thread.
        """
        if self._notice is not None:
            return False
        from vertexrt.checkpoint import PreemptionNotice

        self._notice = PreemptionNotice().install()
        return True

    def uninstall_preemption_handler(self) -> None:
        """Put the SIGTERM handler that was there before ``install_preemption_handler()`` back."""
        if self._notice is not None:
            self._notice.uninstall()
            self._notice = None

    def should_stop(self) -> bool:
        """True when a preemption notice (SIGTERM) arrived on any rank.

        Under torch.distributed it is a collective (an all-reduce MAX run in the background, read at the
        next call): call it at the same points on every rank; every rank then stops at the same call, one
        call after the notice. Save a checkpoint and return from the training function when it is True;
        ``@main`` then exits 143. Needs ``install_preemption_handler()`` (``@main`` calls it).
        """
        if not self._preempted:
            self._preempted = self._vote(self._notice is not None and self._notice.requested)
        return self._preempted

    def close(self, *, drain: bool = True) -> None:
        """Finish the checkpoint save in flight and put the previous SIGTERM handler back.

        ``drain=False`` (after a failure) does not wait for the other ranks' last ``should_stop()``.
        """
        try:
            if drain:
                self._vote.drain()
            if self._checkpoints is not None:
                self._checkpoints.close()
        finally:
            self.uninstall_preemption_handler()

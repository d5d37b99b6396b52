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

from vertexrt.preemption.signals import Subscription, preemption_signal
from vertexrt.preemption.vote import StopVote
from vertexrt.runtime.metrics import MetricsReporter

if TYPE_CHECKING:
    from vertexrt.checkpoint import CheckpointManager, FastTier
    from vertexrt.distributed import Cluster
    from vertexrt.env import Environment
    from vertexrt.runtime.profiling import StepProfiler
    from vertexrt.runtime.watchdog import HangWatchdog


@dataclass
class Context:
    """The environment, cluster position, device, checkpoint manager and metrics of this process.

    Attributes:
        env: the Vertex runtime contract (output dirs, data URIs, job and trial ids).
        cluster: this process's place in the job (role, index, ranks).
        framework: ``"torch"``, ``"tf"`` or ``None``.
        device: a ``torch.device`` for torch, ``"cpu"`` otherwise.
        rank, world_size, local_rank: of this training process, from ``vertexrt.distributed.world_info()``
            (torch.distributed's when it is up, else the cluster's).
        args: the parsed arguments when ``@main`` was given a parser, else ``None``.
        strategy: the ``tf.distribute.Strategy`` for ``framework="tf"``, else ``None``.
        metrics: reports metrics to logs and hypertune (chief only).
        fast: the fast tier (``vertexrt.checkpoint.FastTier``) of the default ``checkpoints`` manager, read
            when that manager is made; ``None``: ``VERTEXRT_FAST_CHECKPOINT_EVERY`` decides. Given by
            ``@vertexrt.main(fast=...)``, ``Trainer(fast=...)`` or ``Context.create(fast=...)``.
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
    fast: FastTier | None = None
    _checkpoints: CheckpointManager | None = field(default=None, repr=False)
    _notice: Subscription | None = field(default=None, repr=False)
    _vote: StopVote = field(default_factory=StopVote, repr=False)
    _preempted: bool = field(default=False, repr=False)
    _preflighted: bool = field(default=False, repr=False)
    _watchdog: HangWatchdog | None = field(
        default=None, repr=False
    )  # @main ran (or skipped) the preflight checks

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
        fast: FastTier | None = None,
    ) -> Context:
        """Read the environment and the cluster now; ranks default to ``vertexrt.distributed.world_info()``.

        ``fast``: the fast tier of the default ``checkpoints`` manager; it wins over
        ``VERTEXRT_FAST_CHECKPOINT_EVERY`` / ``_PEERS``, which apply when it is None.

        With a process group of your own that the cluster variables do not describe and no ``LOCAL_RANK``,
        the local rank picks no GPU on a CPU ``device``: it is the rank when the cluster is one machine
        (every process runs on it), else 0. On a GPU device it must be known (pass ``local_rank=``).

        Raises:
            ClusterSpecError: the cluster description (``CLUSTER_SPEC``, ``TF_CONFIG``, ...) is malformed, or
                the local rank of a GPU process cannot be known.
            ConfigError: ``fast`` is not a ``FastTier``.
        """
        fast = checked_fast_tier(fast, "Context.create(fast=...)")
        from vertexrt.distributed import cluster as read_cluster
        from vertexrt.distributed import world_info
        from vertexrt.env import environment
        from vertexrt.errors import ClusterSpecError

        where, world = read_cluster(), world_info()
        rank = world.rank if rank is None else rank
        if local_rank is None:
            try:
                local_rank = world.local_rank
            except ClusterSpecError:
                if str(device).partition(":")[0] != "cpu":
                    raise
                local_rank = rank if where.num_nodes == 1 else 0
        return cls(
            env=environment(),
            cluster=where,
            framework=framework,
            device=device,
            rank=rank,
            world_size=world.world_size if world_size is None else world_size,
            local_rank=local_rank,
            args=args,
            strategy=strategy,
            metrics=MetricsReporter(is_chief=rank == 0),
            fast=fast,
        )

    @property
    def is_chief(self) -> bool:
        """True on the one process that exports, reports metrics and logs INFO (global rank 0)."""
        return self.rank == 0

    @property
    def replica(self) -> str:
        """The Vertex replica name, e.g. ``workerpool0-0`` (the role, e.g. ``chief-0``, without pools)."""
        return self.cluster.replica

    @property
    def checkpoints(self) -> CheckpointManager:
        """The checkpoint manager on ``env.checkpoint_dir`` (``AIP_CHECKPOINT_DIR``), created on first use.

        It saves every 10 minutes (``EveryNSeconds(600)``), keeps the last 3, and has the fast tier
        :attr:`fast` (else the one ``VERTEXRT_FAST_CHECKPOINT_EVERY`` asks for, else none); assign another
        manager to change the policies, e.g.
        ``ctx.checkpoints = CheckpointManager(save_policy=EveryNSteps(500))``. A ``YoungDaly`` part of its
        save policy is given the job's mean time between failures from the attempt log (on the chief).
        """
        if self._checkpoints is None:
            from vertexrt.checkpoint import CheckpointManager, EveryNSeconds

            self._checkpoints = CheckpointManager(
                self.env.checkpoint_dir,
                save_policy=EveryNSeconds(600),
                rank=self.rank,
                world_size=self.world_size,
                fast=self.fast,
            )
            self._tell_time_between_failures(self._checkpoints)
        return self._checkpoints

    @checkpoints.setter
    def checkpoints(self, manager: CheckpointManager) -> None:
        self._checkpoints = manager
        self._tell_time_between_failures(manager)

    def _tell_time_between_failures(self, manager: CheckpointManager) -> None:
        """Give the parts of ``manager``'s save policy that learn it (``YoungDaly``) this job's mean time
        between failures from the chief's attempt log (the chief decides clock-based saves)."""
        from vertexrt.checkpoint.policies import observers

        policy = getattr(manager, "save_policy", None)
        learners = observers(policy, "observe_mtbf") if policy is not None else []
        if not learners or self.rank != 0:
            return
        from vertexrt.runtime.attempts import job_mean_time_between_failures

        observed = job_mean_time_between_failures(self.env.checkpoint_dir, rank=0, job=self.env.job_id)
        if observed is not None:
            for learner in learners:
                learner.observe_mtbf(*observed)

    def use_fast_tier(self, fast: FastTier, *, option: str = "Context.use_fast_tier(fast)") -> None:
        """Give the default ``checkpoints`` manager the fast tier ``fast`` (before that manager is made).

        ``option`` names where ``fast`` came from in the errors (e.g. ``"Trainer(fast=...)"``).

        Raises:
            ConfigError: ``fast`` is not a ``FastTier``; the manager exists already; or this context was given
                another fast tier before (e.g. by ``@vertexrt.main(fast=...)``).
        """
        from vertexrt.errors import ConfigError

        tier = checked_fast_tier(fast, option)
        if tier is None or tier == self.fast:
            return
        if self._checkpoints is not None:
            raise ConfigError(
                f"{option}: ctx.checkpoints (on {self._checkpoints.directory}) exists already, without this "
                "fast tier; pass fast= before anything uses ctx.checkpoints, or make that manager with "
                "CheckpointManager(..., fast=FastTier(...))"
            )
        if self.fast is not None:
            raise ConfigError(
                f"{option}: this context already has the fast tier {self.fast!r} (e.g. from "
                "@vertexrt.main(fast=...)); give the fast tier in one place"
            )
        self.fast = tier

    @property
    def preempted(self) -> bool:
        """True once ``should_stop()`` has returned True."""
        return self._preempted

    def install_preemption_handler(self) -> bool:
        """Subscribe to the preemption notice: SIGTERM then sets a flag instead of killing the process.

        Returns False when this context already subscribed. Call it from the main thread. The
        process-wide owner (``vertexrt.preemption.signals``) puts the original handler back
        when its last subscriber leaves.
        """
        if self._notice is not None:
            return False
        self._notice = preemption_signal().subscribe()
        return True

    def uninstall_preemption_handler(self) -> None:
        """End this context's subscription (the original SIGTERM handler returns with the last one)."""
        if self._notice is not None:
            self._notice.close()
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

    @property
    def watchdog(self) -> HangWatchdog:
        """The process's hang watchdog (``VERTEXRT_HANG_TIMEOUT``, default 30 min), created on first use.

        Its countdown starts at the first :meth:`step` (or ``watchdog.beat(step)``): a job that never reports
        a step is never ended by it, and time inside ``vertexrt.phases.long_phase(...)`` does not count. The
        Trainer and the Keras callbacks report their steps themselves.
        """
        if self._watchdog is None:
            from vertexrt.runtime.watchdog import process_watchdog

            self._watchdog = process_watchdog(replica=f"{self.replica} rank {self.rank}")
        return self._watchdog

    def step(self, step: int) -> None:
        """Report that ``step`` completed: feeds the hang watchdog (a clock read; call it after every step).

        After ``VERTEXRT_HANG_TIMEOUT`` seconds without a report the watchdog logs every thread's stack and
        the last collectives, and exits so that Vertex restarts the replica; it resumes from its checkpoint.
        """
        self.watchdog.beat(step)

    def profile(self, steps: range, **options: Any) -> StepProfiler:
        """A torch profiler of the steps in ``steps``, traced under ``AIP_TENSORBOARD_LOG_DIR`` (chief only).

        Example:
            >>> with ctx.profile(range(10, 15)) as prof:  # doctest: +SKIP
            ...     for batch in data:
            ...         train_step(batch)
            ...         prof.step()
        """
        from vertexrt.runtime.profiling import StepProfiler

        return StepProfiler(steps, rank=self.rank, log_dir=self.env.tensorboard_log_dir, **options)

    def close(self, *, drain: bool = True) -> None:
        """Finish the checkpoint save in flight and put the previous SIGTERM handler back.

        ``drain=False`` (after a failure) does not wait for the other ranks' last ``should_stop()``.
        """
        try:
            if self._watchdog is not None:
                self._watchdog.stop()
            if drain:
                self._vote.drain()
            if self._checkpoints is not None:
                self._checkpoints.close()
        finally:
            self.uninstall_preemption_handler()


def checked_fast_tier(value: object, option: str) -> FastTier | None:
    """``value`` when it is a ``vertexrt.checkpoint.FastTier`` or None.

    Raises:
        ConfigError: anything else, naming ``option`` (e.g. ``"@vertexrt.main(fast=...)"``).
    """
    from vertexrt.checkpoint.tiers.config import FastTier

    if value is None or isinstance(value, FastTier):
        return value
    from vertexrt.errors import ConfigError

    raise ConfigError(
        f"{option}: got {value!r}; pass a vertexrt.checkpoint.FastTier, e.g. "
        "FastTier(every=EveryNSteps(10)), or None"
    )

"""``Trainer``: an ordinary training loop that resumes, checkpoints, evaluates, reports and exports.

Override ``setup()`` (build the model, optimizer and ``self.train_data``), ``train_step(batch)``, and
optionally ``evaluate()`` and ``export(model_dir)``. What a checkpoint holds:

- attributes holding modules, optimizers, schedulers, data readers (anything with ``state_dict``) and
  random generators, wherever they are assigned;
- JSON-able attributes (``None``, bools, numbers, strings, lists/tuples/dicts of them) first assigned in
  ``setup()`` or later (per-epoch accumulators, counters), each rank its own; ones assigned in
  ``__init__`` are configuration, rebuilt by the restarted job (``self.track("name")`` saves one anyway);
- not: other objects (file handles, tensors held bare), names starting with ``_``, names in ``untracked``
  (e.g. an evaluation reader that should start over).

With several replicas (``world_size > 1``) each module attribute with trainable parameters that is not
already ``DistributedDataParallel``/FSDP and holds no DTensors is wrapped in ``DistributedDataParallel``
after ``setup()``, so gradients are averaged across replicas (``ddp=False`` leaves modules as they are).
Checkpoints hold the unwrapped module's keys (single- and multi-replica checkpoints interchange) and
``export()`` sees the unwrapped modules.

When a module (or a submodule) holds DTensor parameters (FSDP2 ``fully_shard``, tensor parallel), every
rank checkpoints through torch.distributed.checkpoint: each rank's shards of the modules and their
optimizers, the loop position, and each rank's own state (RNG, read position, attributes) under its rank.
A restore onto another world size reshards modules and optimizers and keeps the loop position; per-rank
state starts fresh there, with a warning naming it (see ``vertexrt.runtime.trainer_sharded``).
Such a module must hold no plain trainable parameter (``fully_shard`` on its layers but not on the root, a
norm left out of a tensor-parallel plan): nothing would average its gradients and the ranks' copies would
drift apart silently, so that is a ConfigError at setup naming the parameters (``ddp=False`` skips the check).

``fit()`` restores the newest valid checkpoint (weights, optimizer, step and epoch, this rank's RNG and
read position), loops, saves by the checkpoint manager's policy, evaluates (each epoch, or every
``eval_every`` steps) and reports the metrics to hypertune, writes the progress-line metrics and the
evaluation metrics to TensorBoard (``AIP_TENSORBOARD_LOG_DIR``, chief only), checks for preemption after
every step and inside evaluation (``self.interruptible``), saves a final checkpoint, and exports to
``AIP_MODEL_DIR`` from the chief only. Off Vertex, resuming an earlier run's checkpoint (in
``$VERTEXRT_LOCAL_DIR`` or ``./vertexrt_output/local/``) is logged as a WARNING naming the directory.

Evaluation runs on every rank, usually over its shard; the metrics are averaged across ranks, weighted by
a count, before they are logged, reported to hypertune, saved with the checkpoint (``KeepBest``) and
returned: ``evaluate()`` may return ``{"accuracy": (value, count)}`` (e.g. the examples it scored); a
plain value is weighted by the batches it iterated through ``self.interruptible(...)`` (1 if none).

The read position is exact when ``train_data`` is a vertexrt reader, a ``vertexrt.data.DataLoader``
(any ``num_workers``), a ``vertexrt.data.resumable_loader(dataset, ...)`` over a map-style dataset, or a torch
DataLoader over ``reader.as_torch()`` without worker processes; otherwise a resume replays the epoch and skips
the batches already trained on, and ``fit()`` warns when that cannot be exact (a shuffled ``RandomSampler``).

This module holds the loop and the public API; its parts live beside it: ``trainer_state`` (the loop
position and attributes saved, the ranks' agreement on the step to restore), ``trainer_ddp`` (wrapping
modules in DDP), ``trainer_sharded`` (the DCP layout of DTensor modules), ``trainer_data`` (epochs, read
positions, batch sizes), ``eval_metrics`` (weighting and averaging over ranks), ``trainer_tensorboard``.

Example:
    >>> class MyTrainer(vertexrt.Trainer):
    ...     def setup(self):
    ...         self.model = torch.nn.Linear(4, 2)
    ...         self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.1)
    ...         reader = vertexrt.data.open_dataset("gs://bucket/train-*.jsonl", equalize="drop_remainder")
    ...         self.train_data = vertexrt.data.DataLoader(reader, batch_size=32, num_workers=2)
    ...     def train_step(self, batch):
    ...         loss = ...
    ...         return {"loss": loss}
    ...     def export(self, model_dir):
    ...         ...
    >>> MyTrainer(ctx, max_epochs=3).fit()  # doctest: +SKIP
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable, Iterator, Mapping
from typing import TYPE_CHECKING, Any, TypeVar

from vertexrt import audit
from vertexrt.checkpoint.resuming import log_resuming
from vertexrt.errors import CheckpointCorruptError, ConfigError
from vertexrt.phases import long_phase
from vertexrt.runtime import eval_metrics, trainer_data
from vertexrt.runtime.context import Context
from vertexrt.runtime.entry import Preempted
from vertexrt.runtime.progress import Progress
from vertexrt.runtime.state import StateTracker
from vertexrt.runtime.trainer_ddp import DdpWrapping, unwrap
from vertexrt.runtime.trainer_state import (
    LoopAndAttributes,
    LoopState,
    is_per_rank,
    plain_attributes,
    restore_fast,
    restore_newest,
)
from vertexrt.runtime.trainer_tensorboard import TrainerScalars

if TYPE_CHECKING:
    from vertexrt.checkpoint import CheckpointManager, FastTier

logger = logging.getLogger(__name__)

T = TypeVar("T")


class Trainer(StateTracker):
    """Base class of a resumable training loop; see the module docstring.

    Args:
        ctx: from ``@vertexrt.main``; ``Context.create()`` when omitted.
        max_epochs: epochs to train (ignored once ``max_steps`` is reached).
        max_steps: stop after this many steps in total, if given.
        eval_every: evaluate every N steps; by default at the end of each epoch. The last step is always
            evaluated when ``evaluate`` is overridden.
        checkpoints: a checkpoint manager (its policies decide when to save); default ``ctx.checkpoints``.
        progress_interval: seconds between progress lines.
        progress_bar: tqdm bar (``True``), log lines (``False``), or a bar when interactive (``None``).
        ddp: with several replicas, wrap unsynchronised trainable modules in ``DistributedDataParallel``.
        tensorboard: write metrics to ``AIP_TENSORBOARD_LOG_DIR`` from the chief (scalar events written by
            ``vertexrt.tensorboard_events``: no TensorFlow, torch writer or tensorboard package needed).
        preflight: run ``vertexrt.doctor.preflight`` at the start of ``fit()`` unless ``@main`` already did.
        fast: a fast checkpoint tier (``vertexrt.checkpoint.FastTier``) for the default manager
            ``ctx.checkpoints``; it wins over ``VERTEXRT_FAST_CHECKPOINT_EVERY``. With ``checkpoints=`` it is
            a ConfigError: give that manager ``CheckpointManager(..., fast=FastTier(...))`` instead.
    """

    def __init__(
        self,
        ctx: Context | None = None,
        *,
        max_epochs: int = 1,
        max_steps: int | None = None,
        eval_every: int | None = None,
        checkpoints: CheckpointManager | None = None,
        progress_interval: float = 30.0,
        progress_bar: bool | None = None,
        ddp: bool = True,
        tensorboard: bool = True,
        preflight: bool = True,
        fast: FastTier | None = None,
    ) -> None:
        if max_epochs < 1 and max_steps is None:
            raise ConfigError(f"Trainer(max_epochs={max_epochs}): give max_epochs >= 1 or max_steps")
        if eval_every is not None and eval_every < 1:
            raise ConfigError(f"Trainer(eval_every={eval_every}): give a number of steps >= 1, or None")
        self.ctx = ctx if ctx is not None else Context.create()
        if checkpoints is not None and fast is not None:
            raise ConfigError(
                "Trainer(checkpoints=..., fast=...): the fast tier belongs to the manager; pass "
                "CheckpointManager(..., fast=FastTier(...)) as checkpoints= and drop fast="
            )
        if checkpoints is not None:
            self.ctx.checkpoints = checkpoints
        if fast is not None:
            self.ctx.use_fast_tier(fast, option="Trainer(fast=...)")
        self.max_epochs = max_epochs
        self.max_steps = max_steps
        self.eval_every = eval_every
        self.progress_interval = progress_interval
        self.progress_bar = progress_bar
        self.ddp = ddp
        self.tensorboard = tensorboard
        self.preflight = preflight
        self._loop = LoopState()
        self._saved: dict[str, Any] | None = None  # the loop position of the last checkpoint
        self._tracked_names: set[str] = set()  # names given to track()
        self._config_names: set[str] | None = None  # attributes set before fit(): configuration
        self._ddp_wrapping = DdpWrapping(self)  # the module attributes wrapped in DDP during fit()
        self._eval_batches: int | None = None  # batches through interruptible() in this evaluate()
        self._tb: TrainerScalars | None = None
        self._multi_replica = False  # world_size > 1 (set by fit): one checkpoint shard per rank
        self._layout: Any = None  # a ShardedLayout when modules hold DTensors (FSDP2 / tensor parallel)
        self._replay = False  # the read position was not restored: replay the epoch and skip

    # ---- what the user overrides -------------------------------------------------------------------

    def setup(self) -> None:
        """Build the model, optimizer and ``self.train_data`` (any iterable of batches)."""

    def train_step(self, batch: Any) -> Mapping[str, Any]:
        """Train on one batch; return metrics to show in progress lines (e.g. ``{"loss": loss}``)."""
        raise NotImplementedError(f"{type(self).__name__}.train_step(batch) is not implemented")

    def evaluate(self) -> Mapping[str, Any]:
        """Evaluate the model; the metrics are averaged across ranks, logged and reported to hypertune.

        Return ``{"name": value}`` or ``{"name": (value, count)}``: the value of each rank is weighted by
        its count (e.g. examples scored), by default the batches iterated with ``self.interruptible``.
        Iterate with ``self.interruptible(batches)`` so a preemption during evaluation is honoured.
        Runs on every rank: a collective check happens after each batch.
        """
        return {}

    def export(self, model_dir: str) -> None:
        """Write the final model to ``model_dir`` (``AIP_MODEL_DIR``); called on the chief only.

        Modules the Trainer wrapped in ``DistributedDataParallel`` are unwrapped during this call.
        """
        level = logging.INFO if self.ctx.env.trial_id else logging.WARNING  # a tuning trial may save none
        logger.log(level, "%s.export(model_dir) is not overridden: no model written", type(self).__name__)

    def batch_size(self, batch: Any) -> int:
        """Examples in ``batch`` (for samples/s): the leading dimension of the first array-like leaf."""
        return trainer_data.leading_size(batch)

    # ---- state -------------------------------------------------------------------------------------

    @property
    def step(self) -> int:
        """Optimizer steps done so far (restored on resume)."""
        return self._loop.step

    @property
    def epoch(self) -> int:
        """The current epoch, from 0 (restored on resume)."""
        return self._loop.epoch

    @property
    def checkpoints(self) -> CheckpointManager:
        """The checkpoint manager the loop saves with."""
        return self.ctx.checkpoints

    def track(self, *names: str) -> None:
        """Save these JSON-able attributes with the checkpoint even though ``__init__`` assigns them.

        Example:
            >>> self.best_accuracy = 0.0   # in __init__  # doctest: +SKIP
            >>> self.track("best_accuracy")  # doctest: +SKIP
        """
        self._tracked_names.update(names)

    def state(self) -> dict[str, Any]:
        """The checkpointed tree: ``{"replicated": {...}, "local": {...}}``.

        ``replicated`` holds what every rank has the same copy of (modules, optimizers, schedulers) and is
        written by rank 0 only; ``local`` holds what each rank has its own of (data readers and their
        cursor, generators, the global RNG, the loop position) and is written by every rank as its shard.
        """
        from vertexrt.checkpoint import rng_state

        replicated: dict[str, Any] = {}
        loop = LoopAndAttributes(self._loop, self._attribute_values, self)
        local: dict[str, Any] = {"_loop": loop, "_rng": rng_state()}  # tracked names lack _
        tracked = {name: unwrap(value) for name, value in self.app_state().items()}
        for name, value in tracked.items():
            (local if is_per_rank(value) else replicated)[name] = value
        data = trainer_data.read_position_of(getattr(self, "train_data", None))
        if data is not None and all(data is not value for value in tracked.values()):
            local["_train_data"] = data
        return {"replicated": replicated, "local": local}

    def should_stop(self) -> bool:
        """True once a preemption notice arrived on any rank (a collective under torch.distributed)."""
        return self.ctx.should_stop()

    def interruptible(self, batches: Iterable[T]) -> Iterator[T]:
        """Yield ``batches``, checking for preemption after each; on a notice, save and exit 143.

        Each batch also counts as progress for the hang watchdog (a long evaluation is not a hang).
        """
        beat = self.ctx.watchdog.beat
        for batch in batches:
            if self._eval_batches is not None:
                self._eval_batches += 1
            yield batch
            beat()
            if self.should_stop():
                self._save_and_exit()

    # ---- the loop ----------------------------------------------------------------------------------

    def fit(self) -> dict[str, float]:
        """Train to the end (or until preempted); return the last evaluation metrics.

        Without ``@vertexrt.main`` it installs the SIGTERM handler itself for the duration of the call and
        runs the preflight checks first (``preflight=False`` skips them).

        Raises:
            PreflightError: the preflight checks found a problem that would stop the job.
        """
        if self.preflight and not self.ctx._preflighted:
            from vertexrt import doctor

            doctor.preflight(self.ctx.env, self.ctx.cluster)
            self.ctx._preflighted = True
        if self._config_names is None:
            self._config_names = {name for name in vars(self) if not name.startswith("_")}
        main_thread = threading.current_thread() is threading.main_thread()
        installed = main_thread and self.ctx.install_preemption_handler()
        try:
            return self._fit()
        finally:
            self._ddp_wrapping.unwrap_all()  # after fit, self.model is the user's module again
            if self._tb is not None:
                self._tb.close()
                self._tb = None
            if installed:
                self.ctx.uninstall_preemption_handler()

    def _fit(self) -> dict[str, float]:
        from vertexrt.distributed.collectives import torch_dist

        self._multi_replica = self.ctx.world_size > 1
        if self._multi_replica and torch_dist() is None:
            raise ConfigError(
                f"Trainer with {self.ctx.world_size} replicas needs torch.distributed to agree on "
                "checkpoints and preemption: use @vertexrt.main(framework='torch') or call "
                "vertexrt.init_torch() first (for TensorFlow use the vertexrt.keras callbacks)"
            )
        enabled = self.tensorboard and self.ctx.is_chief  # opened before setup(): before the user seeds
        self._tb = TrainerScalars.open(self.ctx.env.tensorboard_log_dir, enabled=enabled)
        self.setup()
        data = self._train_data()
        trainer_data.check_equalized(data, self.ctx.world_size, type(self).__name__)
        from vertexrt.data.resume_check import warn_if_inexact

        warn_if_inexact(data, f"{type(self).__name__}.train_data")
        if self._multi_replica and self.ddp:
            self._ddp_wrapping.wrap(skip=self.untracked, world_size=self.ctx.world_size)
        full = self.state()
        self._layout = self._sharded_layout(full)
        if self._layout is not None:  # every rank saves its shards and its own state through DCP
            self._tree = self._layout.tree
        else:
            self._tree = full if self.ctx.rank == 0 else {"local": full["local"]}
        self._restore_target = full
        self._restore()  # the hang watchdog is armed by the first completed step: compiling it is no hang
        progress = Progress(
            total_steps=self._total_steps(data),
            start_step=self.step,
            interval=self.progress_interval,
            bar=self.progress_bar,
            enabled=self.ctx.is_chief,
            on_log=self._tb.train if self._tb is not None else None,
        )
        try:
            if self._loop.eval_pending:
                self._evaluate()
            while not self._finished():
                self._train_epoch(data, progress)
        finally:
            progress.close()
        if self.has_evaluate() and self._loop.last_eval_step != self.step:
            self._evaluate()
        if self._saved is None or self._saved["step"] != self.step:  # a step is written once
            self._save(force=True)
        self.checkpoints.wait()
        self.ctx.watchdog.stop()  # an export may take long without a step
        if self.ctx.is_chief:
            logger.info("exporting the model to %s", self.ctx.env.model_dir)
            with self._ddp_wrapping.bare():
                self.export(self.ctx.env.model_dir)
        return dict(self._loop.eval_metrics)

    def has_evaluate(self) -> bool:
        """True when a subclass overrides ``evaluate``."""
        return type(self).evaluate is not Trainer.evaluate

    def _train_data(self) -> Iterable[Any]:
        data = getattr(self, "train_data", None)
        if data is None:
            raise ConfigError(
                f"{type(self).__name__}.fit(): setup() did not set self.train_data; assign the training "
                "batches (a vertexrt.data reader, a DataLoader or any iterable) to self.train_data"
            )
        return data  # type: ignore[no-any-return]

    def _sharded_layout(self, full: dict[str, Any]) -> Any:
        """The DCP layout of the state when a module or optimizer holds DTensors, else None."""
        from vertexrt.checkpoint.dcp import holds_dtensors

        if not holds_dtensors(full["replicated"]):
            return None
        from vertexrt.runtime.trainer_sharded import ShardedLayout

        ctx, pickle = self.ctx, bool(getattr(self.checkpoints, "allow_pickle", False))
        return ShardedLayout(full, self._loop, rank=ctx.rank, world_size=ctx.world_size, allow_pickle=pickle)

    def _attribute_values(self) -> dict[str, Any]:
        """The plain attributes saved with this rank's checkpoint (see the module docstring)."""
        skip = {*self.untracked, *self.app_state(), "train_data"}
        return plain_attributes(
            self, config=self._config_names or set(), tracked=self._tracked_names, skip=skip
        )

    def _restore(self) -> None:
        manager = self.checkpoints
        fast = self._layout is None and manager.fast_directory is not None  # the same on every rank
        if fast and restore_fast(manager, self._restore_fast):
            detail = f"epoch {self.epoch}, batch {self._loop.batch_in_epoch}"
            log_resuming(str(manager.fast_directory), self.step, detail)
            return
        if not restore_newest(manager, self._restore_step, rank=self.ctx.rank):
            return
        self._saved = self._loop.state_dict()
        log_resuming(manager.directory, self.step, f"epoch {self.epoch}, batch {self._loop.batch_in_epoch}")
        if not self.ctx.env.on_vertex and self.ctx.is_chief:
            logger.warning(
                "resuming from %s (step %d), a checkpoint an earlier run left there: to start fresh, set "
                "VERTEXRT_LOCAL_DIR to a new directory (or delete this one)",
                manager.directory,
                self.step,
            )

    def _restore_parts(self) -> list[tuple[Any, int | None]]:
        """What this rank restores, as ``(sub-tree, shard)``: a non-chief replica takes shard 0's replicated
        part and its own."""
        tree, rank = self._restore_target, self.ctx.rank
        if not self._multi_replica or rank == 0:
            return [(tree, 0 if self._multi_replica else None)]
        return [({"replicated": tree["replicated"]}, 0), ({"local": tree["local"]}, rank)]

    def _restore_fast(self) -> bool:
        """Load the fast tier's newest step every rank can get; False when the durable tier is newer."""
        restored = self.checkpoints.restore_fast_shards(self._restore_parts())
        if restored is None:
            return False
        if restored[1]:  # the durable tier holds it too: the end of fit() does not write it again
            self._saved = self._loop.state_dict()
        return True

    def _restore_step(self, step: int) -> Exception | None:
        """Load ``step`` into the tracked state; the error when it failed (a corrupt step is warned about).

        Every error is returned, not raised, so that every rank reaches the agreement that follows.
        """
        manager = self.checkpoints
        try:
            if self._layout is not None:
                if not self._layout.restore(manager, step):
                    self._replay = self._loop.batch_in_epoch > 0
                    if self.ctx.is_chief:
                        attributes = sorted(self._attribute_values())
                        logger.warning("%s", self._layout.not_carried(self._loop, attributes))
            else:  # rank 0 alone reads the manifest and lists the step; the others are sent their bodies
                manager.restore_shards(step, self._restore_parts())
        except CheckpointCorruptError as err:
            logger.warning("skipping checkpoint step %d: %s", step, err)
            return err
        except Exception as err:
            logger.error("restoring checkpoint step %d failed: %s: %s", step, type(err).__name__, err)
            return err
        return None

    def _finished(self) -> bool:
        if self.max_steps is not None and self.step >= self.max_steps:
            return True
        return self.epoch >= self.max_epochs

    def _total_steps(self, data: Iterable[Any]) -> int | None:
        if self.max_steps is not None:
            return self.max_steps
        try:
            return self.max_epochs * len(data)  # type: ignore[arg-type]
        except TypeError:
            return None

    def _train_epoch(self, data: Iterable[Any], progress: Progress) -> None:
        loop = self._loop
        skip = 0
        if loop.batch_in_epoch and loop.batch_in_epoch == trainer_data.batches_per_epoch(data):
            self._end_epoch()  # saved on the epoch's last batch: go on to the next one
            return
        if loop.batch_in_epoch == 0:
            trainer_data.set_epoch(data, loop.epoch)
        elif trainer_data.read_position_of(data) is None or self._replay:
            why = (
                "was saved by another number of ranks" if self._replay else "has no read position to restore"
            )
            self._replay = False
            skip = loop.batch_in_epoch  # no reader state: replay the epoch's order and drop what was seen
            trainer_data.set_epoch(data, loop.epoch)
            logger.warning("train_data %s: skipping %d batches to resume", why, skip)
        # Per-step work stays small: names bound once, one policy question and one preemption check.
        # A step that is evaluated is evaluated before the save question, so its checkpoint has its metrics.
        eval_every, max_steps, world = self.eval_every, self.max_steps, self.ctx.world_size
        at_epoch_end = eval_every is None and self.has_evaluate()
        last_in_epoch = trainer_data.batches_per_epoch(data) if at_epoch_end else None
        train_step, batch_size, should_stop = self.train_step, self.batch_size, self.should_stop
        save, tree = self.checkpoints.save, self._tree
        shard = self.ctx.rank if self._multi_replica else None
        beat = self.ctx.watchdog.beat
        for batch in trainer_data.iterate(data, keep_rng=loop.batch_in_epoch > 0):
            if skip:
                skip -= 1
                continue
            metrics = train_step(batch)
            loop.step += 1
            beat(loop.step)
            loop.batch_in_epoch += 1
            progress.update(loop.step, batch_size(batch) * world, metrics)  # all ranks' samples
            if should_stop():
                self._save_and_exit()
            if max_steps is not None and loop.step >= max_steps:
                return
            if (
                eval_every is not None and loop.step % eval_every == 0
            ) or loop.batch_in_epoch == last_in_epoch:
                self._evaluate()
            if save(loop.step, tree, loop.eval_metrics, shard=shard):  # when the save policy says so
                self._saved = loop.state_dict()
        if progress.total_steps is None and self.max_steps is None:
            progress.set_total(self.max_epochs * loop.batch_in_epoch)
        self._end_epoch()

    def _end_epoch(self) -> None:
        loop = self._loop
        audit.event("epoch_end", step=loop.step, epoch=loop.epoch)
        loop.epoch += 1
        loop.batch_in_epoch = 0
        if self.eval_every is None and self.has_evaluate() and loop.last_eval_step != loop.step:
            self._evaluate()

    def _evaluate(self) -> None:
        if not self.has_evaluate():
            return
        from vertexrt.distributed.collectives import torch_dist

        self._loop.eval_pending = True  # saved only if preempted inside evaluate(): redone on resume
        self._eval_batches = 0
        audit.event("eval", step=self._loop.step)
        with long_phase("evaluation"):  # not a hang, however long, nor is waiting for a slower rank's
            try:
                returned = self.evaluate()
                counted = self._eval_batches
            finally:
                self._eval_batches = None
                audit.event("eval_end", step=self._loop.step)
            dist = torch_dist() if self._multi_replica else None
            metrics = eval_metrics.average_over_ranks(eval_metrics.weighted(returned, counted or 1), dist)
        self._loop.eval_pending = False
        self._loop.last_eval_step = self.step
        self._loop.eval_metrics = metrics
        if metrics:
            self.ctx.metrics.report(metrics, step=self.step)
            if self._tb is not None:
                self._tb.evaluation(self.step, metrics)

    def _save(self, *, force: bool) -> None:
        shard = self.ctx.rank if self._multi_replica else None
        if self.checkpoints.save(self.step, self._tree, self._loop.eval_metrics, force=force, shard=shard):
            self._saved = self._loop.state_dict()

    def _save_and_exit(self) -> None:
        saved = self._saved
        if saved is not None and saved["step"] == self.step:
            # A step is committed once. Preempted in an evaluation that followed its save: the resumed run
            # redoes the evaluation, as this step's last_eval_step says it was not done.
            logger.warning("preemption notice: step %d is already saved; exiting", self.step)
        else:  # e.g. preempted in evaluate(): eval_pending is saved, so the resumed run redoes it
            logger.warning("preemption notice: saving the checkpoint of step %d", self.step)
            self._save(force=True)
        self.checkpoints.wait()
        raise Preempted(self.step)

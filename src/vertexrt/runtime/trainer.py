"""``Trainer``: an ordinary training loop that resumes, checkpoints, evaluates, reports and exports.

Override ``setup()`` (build the model, optimizer and ``self.train_data``), ``train_step(batch)``, and
optionally ``evaluate()`` and ``export(model_dir)``. Attributes holding modules, optimizers, schedulers,
data readers (anything with ``state_dict``) and random generators are checkpointed automatically; list
an attribute in ``untracked`` to leave it out (e.g. an evaluation reader that should start over).

``fit()`` restores the newest valid checkpoint (weights, optimizer, step and epoch, this rank's RNG and
read position), loops, saves by the checkpoint manager's policy, evaluates (each epoch, or every
``eval_every`` steps) and reports the metrics to hypertune, shows progress, checks for preemption after
every step and inside evaluation (``self.interruptible``), saves a final checkpoint, and exports to
``AIP_MODEL_DIR`` from the chief only.

The read position is exact when ``train_data`` is a vertexrt reader, a ``vertexrt.data.DataLoader``
(any ``num_workers``) or a torch DataLoader over ``reader.as_torch()`` without worker processes; otherwise
a resume replays the epoch and skips the batches already trained on.

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

import itertools
import logging
import threading
import types
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import asdict, dataclass, field, fields
from typing import TYPE_CHECKING, Any, TypeVar

from vertexrt.errors import ConfigError
from vertexrt.runtime.context import Context
from vertexrt.runtime.entry import Preempted
from vertexrt.runtime.progress import Progress
from vertexrt.runtime.state import GeneratorState, StateTracker, as_stateful

if TYPE_CHECKING:
    from vertexrt.checkpoint import CheckpointManager

logger = logging.getLogger(__name__)

T = TypeVar("T")


@dataclass
class LoopState:
    """Where the loop is; saved with every checkpoint under ``"_loop"``."""

    step: int = 0
    epoch: int = 0
    batch_in_epoch: int = 0
    last_eval_step: int = -1
    eval_pending: bool = False
    eval_metrics: dict[str, float] = field(default_factory=dict)

    def state_dict(self) -> dict[str, Any]:
        return asdict(self)

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        for f in fields(self):
            if f.name in state:
                setattr(self, f.name, state[f.name])


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
    ) -> None:
        if max_epochs < 1 and max_steps is None:
            raise ConfigError(f"Trainer(max_epochs={max_epochs}): give max_epochs >= 1 or max_steps")
        if eval_every is not None and eval_every < 1:
            raise ConfigError(f"Trainer(eval_every={eval_every}): give a number of steps >= 1, or None")
        self.ctx = ctx if ctx is not None else Context.create()
        if checkpoints is not None:
            self.ctx.checkpoints = checkpoints
        self.max_epochs = max_epochs
        self.max_steps = max_steps
        self.eval_every = eval_every
        self.progress_interval = progress_interval
        self.progress_bar = progress_bar
        self._loop = LoopState()
        self._saved: dict[str, Any] | None = None  # the loop position of the last checkpoint

    # ---- what the user overrides -------------------------------------------------------------------

    def setup(self) -> None:
        """Build the model, optimizer and ``self.train_data`` (any iterable of batches)."""

    def train_step(self, batch: Any) -> Mapping[str, Any]:
        """Train on one batch; return metrics to show in progress lines (e.g. ``{"loss": loss}``)."""
        raise NotImplementedError(f"{type(self).__name__}.train_step(batch) is not implemented")

    def evaluate(self) -> Mapping[str, float]:
        """Evaluate the model; the metrics returned are logged and reported to hypertune.

        Iterate with ``self.interruptible(batches)`` so a preemption during evaluation is honoured.
        Runs on every rank: a collective check happens after each batch.
        """
        return {}

    def export(self, model_dir: str) -> None:
        """Write the final model to ``model_dir`` (``AIP_MODEL_DIR``); called on the chief only."""
        logger.warning("%s.export(model_dir) is not overridden: no model written", type(self).__name__)

    def batch_size(self, batch: Any) -> int:
        """Examples in ``batch`` (for samples/s): the leading dimension of the first array-like leaf."""
        return _leading_size(batch)

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

    def state(self) -> dict[str, Any]:
        """The checkpointed tree: ``{"replicated": {...}, "local": {...}}``.

        ``replicated`` holds what every rank has the same copy of (modules, optimizers, schedulers) and is
        written by rank 0 only; ``local`` holds what each rank has its own of (data readers and their
        cursor, generators, the global RNG, the loop position) and is written by every rank as its shard.
        """
        from vertexrt.checkpoint import rng_state

        replicated: dict[str, Any] = {}
        local: dict[str, Any] = {"_loop": self._loop, "_rng": rng_state()}  # tracked names never start with _
        tracked = self.app_state()
        for name, value in tracked.items():
            (local if _is_per_rank(value) else replicated)[name] = value
        data = _cursor_of(getattr(self, "train_data", None))
        if data is not None and all(data is not value for value in tracked.values()):
            local["_train_data"] = data
        return {"replicated": replicated, "local": local}

    def should_stop(self) -> bool:
        """True once a preemption notice arrived on any rank (a collective under torch.distributed)."""
        return self.ctx.should_stop()

    def interruptible(self, batches: Iterable[T]) -> Iterator[T]:
        """Yield ``batches``, checking for preemption after each; on a notice, save and exit 143."""
        for batch in batches:
            yield batch
            if self.should_stop():
                self._save_and_exit()

    # ---- the loop ----------------------------------------------------------------------------------

    def fit(self) -> dict[str, float]:
        """Train to the end (or until preempted); return the last evaluation metrics.

        Without ``@vertexrt.main`` it installs the SIGTERM handler itself for the duration of the call.
        """
        main_thread = threading.current_thread() is threading.main_thread()
        installed = main_thread and self.ctx.install_preemption_handler()
        try:
            return self._fit()
        finally:
            if installed:
                self.ctx.uninstall_preemption_handler()

    def _fit(self) -> dict[str, float]:
        from vertexrt.checkpoint.collective import torch_dist

        self._sharded = self.ctx.world_size > 1
        if self._sharded and torch_dist() is None:
            raise ConfigError(
                f"Trainer with {self.ctx.world_size} replicas needs torch.distributed to agree on "
                "checkpoints and preemption: use @vertexrt.main(framework='torch') or call "
                "vertexrt.init_torch() first (for TensorFlow use the vertexrt.keras callbacks)"
            )
        self.setup()
        data = self._train_data()
        full = self.state()
        self._tree = full if self.ctx.rank == 0 else {"local": full["local"]}
        self._restore_target = full
        self._restore()
        progress = Progress(
            total_steps=self._total_steps(data),
            start_step=self.step,
            interval=self.progress_interval,
            bar=self.progress_bar,
            enabled=self.ctx.is_chief,
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
        if self.ctx.is_chief:
            logger.info("exporting the model to %s", self.ctx.env.model_dir)
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

    def _restore(self) -> None:
        from vertexrt.checkpoint.collective import any_rank, broadcast, torch_dist

        manager, dist = self.checkpoints, torch_dist()
        newest_first = broadcast(manager.all_steps()[::-1] if self.ctx.rank == 0 else None, dist)
        for step in newest_first:  # every rank tries the same step; all move on if any rank fails it
            failed = not self._restore_step(step)
            if not any_rank(failed, dist):
                break
            logger.warning("checkpoint step %d is unusable on some rank: trying the previous one", step)
        else:
            what = "no usable checkpoint" if newest_first else "no checkpoint"
            logger.info("%s in %s: starting from step 0", what, manager.directory)
            return
        self._saved = self._loop.state_dict()
        logger.info(
            "resumed from the checkpoint of step %d (epoch %d, batch %d of the epoch) in %s",
            self.step,
            self.epoch,
            self._loop.batch_in_epoch,
            manager.directory,
        )

    def _restore_step(self, step: int) -> bool:
        """Load ``step`` into the tracked state; False (with a warning) when it fails verification."""
        from vertexrt.checkpoint import CheckpointCorruptError

        manager, rank, tree = self.checkpoints, self.ctx.rank, self._restore_target
        try:
            if not self._sharded or rank == 0:
                manager.restore(tree, step=step, shard=0 if self._sharded else None)
            else:
                manager.restore({"replicated": tree["replicated"]}, step=step, shard=0)
                manager.restore({"local": tree["local"]}, step=step, shard=rank)
        except CheckpointCorruptError as err:
            logger.warning("skipping checkpoint step %d: %s", step, err)
            return False
        return True

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
        if loop.batch_in_epoch == 0:
            _set_epoch(data, loop.epoch)
        elif _cursor_of(data) is None:
            skip = loop.batch_in_epoch  # no reader state: replay the epoch's order and drop what was seen
            _set_epoch(data, loop.epoch)
            logger.warning("train_data has no read position to restore: skipping %d batches to resume", skip)
        # Per-step work stays small: names bound once, one policy question and one preemption check.
        eval_every, max_steps, world = self.eval_every, self.max_steps, self.ctx.world_size
        train_step, batch_size, should_stop = self.train_step, self.batch_size, self.should_stop
        save, tree, shard = self.checkpoints.save, self._tree, self.ctx.rank if self._sharded else None
        for batch in _iterate(data, keep_rng=loop.batch_in_epoch > 0):
            if skip:
                skip -= 1
                continue
            metrics = train_step(batch)
            loop.step += 1
            loop.batch_in_epoch += 1
            progress.update(loop.step, batch_size(batch) * world, metrics)  # all ranks' samples
            if should_stop():
                self._save_and_exit()
            if max_steps is not None and loop.step >= max_steps:
                return
            if save(loop.step, tree, loop.eval_metrics, shard=shard):  # when the save policy says so
                self._saved = loop.state_dict()
            if eval_every is not None and loop.step % eval_every == 0:
                self._evaluate()
        steps_in_epoch = loop.batch_in_epoch
        loop.epoch += 1
        loop.batch_in_epoch = 0
        if progress.total_steps is None and self.max_steps is None:
            progress.set_total(self.max_epochs * steps_in_epoch)
        if eval_every is None and self.has_evaluate():
            self._evaluate()

    def _evaluate(self) -> None:
        if not self.has_evaluate():
            return
        self._loop.eval_pending = True  # saved only if preempted inside evaluate(): redone on resume
        metrics = {name: float(value) for name, value in self.evaluate().items()}
        self._loop.eval_pending = False
        self._loop.last_eval_step = self.step
        self._loop.eval_metrics = metrics
        if metrics:
            self.ctx.metrics.report(metrics, step=self.step)

    def _save(self, *, force: bool) -> None:
        shard = self.ctx.rank if self._sharded else None
        if self.checkpoints.save(self.step, self._tree, self._loop.eval_metrics, force=force, shard=shard):
            self._saved = self._loop.state_dict()

    def _save_and_exit(self) -> None:
        logger.warning("preemption notice: saving the checkpoint of step %d", self.step)
        if self._saved != self._loop.state_dict():  # e.g. preempted in evaluate(): record it to redo it
            self._save(force=True)
        self.checkpoints.wait()
        raise Preempted(self.step)


def _iterate(data: Iterable[T], *, keep_rng: bool) -> Iterator[T]:
    """``iter(data)``; with ``keep_rng``, starting it leaves the global RNGs where they are.

    A torch DataLoader draws a seed from torch's generator when its iterator starts. Resuming mid-epoch,
    the original run drew it at the epoch start, before the restored RNG state: drawing it again would
    shift every later random number. A generator-based loader draws it at its first batch, so that batch
    is fetched before the RNG state is put back.
    """
    if not keep_rng:
        return iter(data)
    from vertexrt.checkpoint import rng_state

    rng = rng_state()
    before = rng.state_dict()
    batches = iter(data)
    lazy = isinstance(batches, types.GeneratorType)
    started = list(itertools.islice(batches, 1)) if lazy else []
    rng.load_state_dict(before)
    return itertools.chain(started, batches) if lazy else batches


def _set_epoch(data: Any, epoch: int) -> None:
    """Call ``set_epoch`` on the data, or on a DataLoader's dataset / sampler."""
    for target in (data, getattr(data, "dataset", None), getattr(data, "sampler", None)):
        set_epoch = getattr(target, "set_epoch", None)
        if callable(set_epoch):
            set_epoch(epoch)
            return


def _cursor_of(data: Any) -> Any:
    """What holds the read position of ``data``: itself, a DataLoader's dataset, or None.

    A DataLoader with worker processes reads in the workers: its dataset's position in this process never
    moves, so it counts as none (resuming then replays the epoch's order and skips what was seen).
    """
    if as_stateful(data) is not None:
        return data
    dataset = getattr(data, "dataset", None)
    workers = int(getattr(data, "num_workers", 0) or 0)
    return None if dataset is None or workers > 0 or as_stateful(dataset) is None else dataset


def _is_per_rank(value: Any) -> bool:
    """Generators and data (iterables that are not modules) differ per rank; the rest is replicated."""
    if isinstance(value, GeneratorState):
        return True
    return hasattr(value, "__iter__") and not hasattr(value, "parameters")


def _leading_size(batch: Any) -> int:
    shape = getattr(batch, "shape", None)
    if shape is not None:
        return int(shape[0]) if len(shape) else 1
    kind = type(batch)
    if kind is dict or (kind is not list and kind is not tuple and isinstance(batch, Mapping)):
        return _leading_size(next(iter(batch.values()))) if batch else 0
    if kind is list or kind is tuple or isinstance(batch, (list, tuple)):
        if batch and getattr(batch[0], "shape", None) is not None:
            return _leading_size(batch[0])
        return len(batch)
    return 1

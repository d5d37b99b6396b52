"""Keras callbacks: checkpoints with mid-epoch resume, hypertune reports, and a save-and-stop on SIGTERM.

Works with tf-keras (`TF_USE_LEGACY_KERAS=1`, needed for `fit` under MultiWorkerMirroredStrategy on
TF 2.21) and, single-worker, with Keras 3 (which resumes at the start of the checkpoint's epoch: its
`fit` cannot start mid-epoch). The callbacks subclass `tf.keras.callbacks.Callback`, i.e. whichever
Keras `TF_USE_LEGACY_KERAS` selects; import this module after setting it.

A checkpoint holds the model weights, the optimizer's variables and the position: epoch, batches done
in that epoch, and global batches done (`step`). To resume mid-epoch the data must restart where it
stopped: use a deterministic, repeated dataset with `steps_per_epoch` and skip `position.step` batches.

Example:
    >>> from vertexrt.checkpoint import CheckpointManager, EveryNSteps
    >>> from vertexrt import keras as vk
    >>> manager = CheckpointManager(save_policy=EveryNSteps(100))
    >>> ckpt = vk.CheckpointCallback(manager)
    >>> position = ckpt.restore(model)              # loads the newest checkpoint, if any
    >>> data = dataset.repeat().skip(position.step)  # the batches not trained on yet
    >>> model.fit(data, epochs=10, steps_per_epoch=500, callbacks=[
    ...     ckpt, vk.PreemptionCallback(manager), vk.HypertuneCallback("val_accuracy")])
"""

from __future__ import annotations

import logging
import weakref
from typing import Any, NamedTuple

import tensorflow as tf

from vertexrt import hypertune
from vertexrt.errors import CheckpointError, ConfigError

logger = logging.getLogger(__name__)

_last_saved: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()  # manager -> step


class Position(NamedTuple):
    """Where training stands: `epoch` (0-based), `batch` (batches done in it), `step` (batches done)."""

    epoch: int = 0
    batch: int = 0
    step: int = 0


class _ResumeAt:
    """tf-keras asks `model._training_state` where `fit` starts (as its BackupAndRestore does)."""

    def __init__(self, position: Position) -> None:
        self.position = position

    def maybe_load_initial_counters_from_ckpt(
        self, steps_per_epoch: int, initial_epoch: int, mode: Any = None
    ) -> tuple[int, int]:
        if self.position.epoch < initial_epoch:
            return initial_epoch, 0
        return self.position.epoch, self.position.batch


class _Tracked(tf.keras.callbacks.Callback):  # type: ignore[misc, name-defined]
    """Tracks the position during `fit` and builds the state tree a checkpoint holds.

    The global step is the optimizer's `iterations` (checkpointed with it), the epoch and the batch
    are what `fit` reports, so callbacks sharing a manager agree without talking to each other.
    """

    def __init__(self, manager: Any) -> None:
        super().__init__()
        self.manager = manager
        self.position = Position()

    def state(self, model: Any, position: Position | None = None) -> dict[str, Any]:
        """The checkpointed tree: weights, optimizer variables, position (live objects, not copies)."""
        position = position or self.position
        optimizer = getattr(model, "optimizer", None)
        return {
            "model": model,
            "optimizer": list(optimizer.variables) if optimizer is not None else [],
            "position": {
                "epoch": position.epoch,
                "batch": position.batch,
                "step": position.step,
                "steps_per_epoch": int((getattr(self, "params", None) or {}).get("steps") or 0),
            },
        }

    def on_epoch_begin(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        self.position = Position(epoch, 0, self.position.step)

    def on_train_batch_end(self, batch: int, logs: dict[str, Any] | None = None) -> None:
        # fit passes the index of the last batch run: batch + 1 are done in this epoch
        self.position = Position(self.position.epoch, batch + 1, _global_step(self.model))

    def _save(self, logs: dict[str, Any] | None, force: bool) -> bool:
        step = self.position.step
        if _last_saved.get(self.manager) == step:
            return False
        metrics = {k: float(v) for k, v in (logs or {}).items() if _is_number(v)}
        saved = bool(self.manager.save(step, self.state(self.model), metrics=metrics, force=force))
        if saved:
            _last_saved[self.manager] = step
        return saved


class CheckpointCallback(_Tracked):
    """Save through a `vertexrt.checkpoint.CheckpointManager` by its save policy; resume mid-epoch.

    Every batch asks the manager's save policy (e.g. `EveryNSteps(100)`); the end of every epoch saves
    unconditionally when `save_at_epoch_end`. `restore(model)` (called by `fit` if you did not) loads the
    newest checkpoint and returns its `Position`; with tf-keras, `fit` then continues at that epoch and
    batch. Feed the data from `position.step` on (see the module example).
    """

    def __init__(self, manager: Any, *, save_at_epoch_end: bool = True) -> None:
        super().__init__(manager)
        self.save_at_epoch_end = save_at_epoch_end
        self._restored: Position | None = None
        self._resume_pending = False

    def restore(self, model: Any = None) -> Position:
        """Load the newest checkpoint into `model` (weights, optimizer) and return where it stopped.

        A fresh start returns `Position(0, 0, 0)`. The model must be built (known input shape).
        """
        if self._restored is not None:
            return self._restored
        model = model if model is not None else self.model
        if self.manager.latest_step() is None:
            self._restored = Position()
            return self._restored
        if not getattr(model, "built", False):
            raise CheckpointError(
                f"CheckpointCallback.restore: model {model.name!r} is not built, so it has no weights to "
                "load into; give it an input shape (keras.Input) or call model.build(shape) first"
            )
        with model.distribute_strategy.scope():
            optimizer = getattr(model, "optimizer", None)
            if optimizer is not None:
                optimizer.build(model.trainable_variables)  # create the slots the checkpoint fills
            restored = self.manager.restore(target=self.state(model, Position()))
        saved = restored["position"]
        position = Position(int(saved["epoch"]), int(saved["batch"]), int(saved["step"]))
        if saved["steps_per_epoch"] and position.batch >= saved["steps_per_epoch"]:
            position = Position(position.epoch + 1, 0, position.step)  # saved after an epoch's last batch
        logger.info(
            "resumed from checkpoint step %d in %s: epoch %d, batch %d",
            self.manager.restored_step,
            self.manager.directory,
            position.epoch,
            position.batch,
        )
        _last_saved[self.manager] = position.step
        self._restored = self.position = position
        self._resume_pending = True
        return position

    def on_train_begin(self, logs: dict[str, Any] | None = None) -> None:
        position = self.restore(self.model)
        if not self._resume_pending:
            return
        self._resume_pending = False
        self.position = position
        if hasattr(self.model, "_training_state"):  # tf-keras: fit reads the start epoch/batch from it
            self.model._training_state = _ResumeAt(position)
        else:  # Keras 3: fit restarts at an epoch boundary only
            self.model._initial_epoch = position.epoch
            if position.batch:
                logger.warning(
                    "Keras 3 cannot start fit mid-epoch: epoch %d restarts at batch 0 although the "
                    "checkpoint had %d batches done; use tf-keras (TF_USE_LEGACY_KERAS=1) to resume exactly",
                    position.epoch,
                    position.batch,
                )
                self.position = Position(position.epoch, 0, position.step)

    def on_train_batch_end(self, batch: int, logs: dict[str, Any] | None = None) -> None:
        super().on_train_batch_end(batch, logs)
        self._save(logs, force=False)

    def on_epoch_end(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        if self.save_at_epoch_end:
            self._save(logs, force=True)

    def on_train_end(self, logs: dict[str, Any] | None = None) -> None:
        if isinstance(getattr(self.model, "_training_state", None), _ResumeAt):
            self.model._training_state = None
        self.manager.wait()


class PreemptionCallback(_Tracked):
    """On SIGTERM: save a checkpoint at the next batch boundary and exit with status 143 (128 + SIGTERM).

    Installs the manager's flag-only SIGTERM handler at the start of `fit`. Under a multi-worker
    strategy the workers agree (an all-reduce of the flag, ~3 ms on CPU) every `check_every` steps, so
    they all stop at the same batch. The exit skips the rest of the epoch (validation would eat the
    grace period); with `exit=False`, `fit` stops after the epoch instead and `preempted` is True.
    """

    def __init__(self, manager: Any, *, check_every: int = 1, exit: bool = True) -> None:
        super().__init__(manager)
        if check_every < 1:
            raise ConfigError(
                f"PreemptionCallback(check_every={check_every}): use a positive number of steps"
            )
        self.check_every = check_every
        self.exit = exit
        self.preempted = False
        self._agree: Any = None

    def on_train_begin(self, logs: dict[str, Any] | None = None) -> None:
        self.manager.save_on_preemption()
        strategy = self.model.distribute_strategy
        if isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy):
            self._agree = _agreement(strategy)

    def on_train_batch_end(self, batch: int, logs: dict[str, Any] | None = None) -> None:
        super().on_train_batch_end(batch, logs)
        if self.preempted:
            return
        requested = self.manager.preemption_requested()
        if self._agree is not None:  # every worker must take part in the same all-reduces
            if self.position.step % self.check_every:
                return
            requested = int(self._agree(tf.constant(int(requested))).numpy()) > 0
        if not requested:
            return
        logger.warning("preemption: saving step %d and stopping training", self.position.step)
        self._save(logs, force=True)
        self.manager.wait()
        self.preempted = True
        self.model.stop_training = True
        if self.exit:
            from vertexrt.checkpoint import EXIT_CODE

            self.manager.close()
            raise SystemExit(EXIT_CODE)


class HypertuneCallback(tf.keras.callbacks.Callback):  # type: ignore[misc, name-defined]
    """Report `logs[key]` (default: `metric`) to the tuning service at the end of every epoch.

    Example:
        >>> model.fit(..., validation_data=val, callbacks=[HypertuneCallback("val_accuracy")])
    """

    def __init__(self, metric: str, key: str | None = None) -> None:
        super().__init__()
        self.metric = metric
        self.key = key or metric
        self._done = 0  # batches done in the current epoch

    def on_train_batch_end(self, batch: int, logs: dict[str, Any] | None = None) -> None:
        self._done = batch + 1

    def on_epoch_end(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        steps = (getattr(self, "params", None) or {}).get("steps")
        if steps and self._done < steps:  # stopped mid-epoch (preemption): not a result to tune on
            logger.info("epoch %d stopped after %d of %d batches: not reported", epoch + 1, self._done, steps)
            return
        logs = logs or {}
        if self.key not in logs:
            raise ConfigError(
                f"HypertuneCallback({self.metric!r}): the epoch logs have no {self.key!r}; they have "
                f"{sorted(logs)}. Pass key= one of them (validation metrics need validation_data)"
            )
        hypertune.report(self.metric, float(logs[self.key]), step=epoch + 1)


def _is_number(value: Any) -> bool:
    try:
        float(value)
    except (TypeError, ValueError):
        return False
    return True


def _global_step(model: Any) -> int:
    """Batches trained so far: the optimizer's iteration counter (restored with the checkpoint)."""
    return int(model.optimizer.iterations.numpy())


def _agreement(strategy: Any) -> Any:
    """A compiled all-reduce (SUM) of one int32 across the strategy's workers (eager costs ~3x more)."""

    @tf.function
    def agree(flag: Any) -> Any:
        per_replica = strategy.run(tf.identity, args=(flag,))
        return strategy.reduce(tf.distribute.ReduceOp.SUM, per_replica, axis=None)

    return agree

"""Keras on Vertex AI: checkpoints with exact resume, save-and-stop on SIGTERM, hypertune reports, TensorBoard
that works with `gs://`, and a multi-worker-safe model export.

Works with tf-keras (`TF_USE_LEGACY_KERAS=1`, needed for `fit` under MultiWorkerMirroredStrategy on
TF 2.21) and, single-worker, with Keras 3 (which resumes at the start of the checkpoint's epoch: its
`fit` cannot start mid-epoch). The callbacks subclass `tf.keras.callbacks.Callback`, i.e. whichever
Keras `TF_USE_LEGACY_KERAS` selects; import this module after setting it.

A checkpoint holds the model weights, the optimizer's variables, the position (epoch, batches done in
that epoch, global batches done = `step`) and, with `CheckpointCallback(manager, data=reader)`, the read
position of a `vertexrt.data` reader: `ckpt.as_tf(batch_size)` feeds `fit` from the reader and a restart
continues with the next record this worker has not trained on, on every worker, with no arithmetic (tf-keras
resumes mid-epoch; Keras 3 restarts the interrupted epoch's batch count but neither skips nor repeats data).

Example:
    >>> from vertexrt.checkpoint import CheckpointManager, EveryNSteps
    >>> from vertexrt.data import open_dataset
    >>> from vertexrt import keras as vk
    >>> reader = open_dataset("gs://my-bucket/train-*.jsonl")
    >>> manager = CheckpointManager(save_policy=EveryNSteps(100))
    >>> ckpt = vk.CheckpointCallback(manager, data=reader)
    >>> position = ckpt.restore(model)        # weights, optimizer and the reader's position, if any
    >>> train = ckpt.as_tf(batch_size=256).map(lambda b: (b["x"], b["label"]))
    >>> model.fit(train, epochs=10, steps_per_epoch=500, callbacks=[
    ...     ckpt, vk.PreemptionCallback(manager), vk.HypertuneCallback("val_accuracy"), vk.TensorBoard()])
    >>> vk.export(model)                      # every worker calls it; the chief's copy lands in AIP_MODEL_DIR

Without a vertexrt reader (an in-memory `tf.data` pipeline sharded with `AutoShardPolicy.DATA`), make the
data deterministic and repeated, and skip `position.step` global batches before sharding:
`dataset.repeat().skip(position.step)`.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import shutil
import tempfile
import weakref
from collections.abc import Iterator
from typing import Any, NamedTuple

import tensorflow as tf

from vertexrt import audit, hypertune
from vertexrt.errors import CheckpointError, ConfigError, DataError
from vertexrt.preemption.signals import PREEMPTED_EXIT_CODE, Subscription, preemption_signal
from vertexrt.preemption.vote import StopVote

logger = logging.getLogger(__name__)

_last_saved: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()  # manager -> step
_readers: weakref.WeakKeyDictionary[Any, _ReadPosition] = weakref.WeakKeyDictionary()  # manager -> reader


class Position(NamedTuple):
    """Where training stands: `epoch` (0-based), `batch` (batches done in it), `step` (batches done)."""

    epoch: int = 0
    batch: int = 0
    step: int = 0


class _ReadPosition:
    """How far the model has trained through a vertexrt reader: `(reader epoch, records into it)`.

    The tf.data pipeline reads ahead of training, so the reader's own cursor is not where the model is.
    This worker's records per step are fixed (the global batch split across the replicas), so the model's
    place is `records consumed = (step - origin step) x records per step` counted from the origin (the
    restored place), walked over the reader epochs whose lengths the generator has seen. With several
    workers every reader yields the same count per epoch (`equalize`), so the place is the same on every
    worker and the chief's checkpoint holds it for all of them.
    """

    def __init__(self, reader: Any) -> None:
        self.reader = reader
        self.origin = (reader.epoch, 0, 0)  # (reader epoch, records into it, global step)
        self.ends: dict[int, int] = {}  # reader epoch -> records it had (filled by the generator)
        self.per_step = 0  # records this worker trains on per step (set at the start of fit)

    def seek(self, epoch: int, records: int, step: int) -> None:
        """Move the reader to `records` into reader epoch `epoch` (re-reads them: O(records))."""
        self.reader.set_epoch(epoch)
        if records:
            logger.info(
                "reading %d records of data epoch %d again to reach the checkpoint's place", records, epoch
            )
            stream = iter(self.reader)
            done = sum(1 for _ in itertools.islice(stream, records))
            stream.close()  # type: ignore[attr-defined]
            if done < records:
                raise CheckpointError(
                    f"the checkpoint is {records} records into data epoch {epoch}, but this reader has only "
                    f"{done}: open the dataset exactly as in the run that saved it (files, shuffle, seed, "
                    "equalize, number of workers)"
                )
        self.origin = (epoch, records, step)
        self.ends = {}

    def records(self) -> Iterator[Any]:
        """The reader's records, epoch after epoch, without end (runs in tf.data's generator thread)."""
        empty = 0  # epochs in a row without a record (one is normal right after a seek to an epoch's end)
        while True:
            epoch, done = self.reader.epoch, 0
            for record in self.reader:
                done += 1
                yield record
            first = self.origin[1] if epoch == self.origin[0] else 0
            self.ends[epoch] = first + done
            empty = 0 if done else empty + 1
            if empty == 2:
                raise DataError(
                    f"{self.reader!r} yields no records for this worker: there is no data to train on"
                )

    def at(self, step: int) -> dict[str, int]:
        """The place after `step` global steps: `{"epoch": e, "records": k}`."""
        epoch, records, origin_step = self.origin
        records += (step - origin_step) * self.per_step
        while epoch in self.ends and records >= self.ends[epoch]:
            records -= self.ends[epoch]
            epoch += 1
        return {"epoch": epoch, "records": records}


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


def _watchdog() -> Any:
    from vertexrt.runtime.watchdog import process_watchdog

    return process_watchdog()


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
        """The checkpointed tree: weights, optimizer variables, position, the reader's place (if tracked)."""
        position = position or self.position
        optimizer = getattr(model, "optimizer", None)
        reader = _readers.get(self.manager)
        extra = {} if reader is None else {"data": reader.at(position.step)}
        return extra | {
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
        _watchdog().beat(self.position.step)  # a batch that never ends is a hang

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
    batch.

    With `data=` a `vertexrt.data` reader, train on `as_tf(batch_size)`: every checkpoint also holds where
    training is in the reader, and `restore` puts the reader there on every worker (re-reading that part of
    its current data epoch once). Several workers need equal shares (`equalize`, the default with several
    replicas). Without `data=`, feed the data from `position.step` on (see the module docstring).
    """

    def __init__(self, manager: Any, *, data: Any = None, save_at_epoch_end: bool = True) -> None:
        super().__init__(manager)
        self.save_at_epoch_end = save_at_epoch_end
        self._restored: Position | None = None
        self._resume_pending = False
        self.data = data
        self._batch_size: int | None = None
        self._reader: _ReadPosition | None = None
        if data is not None:
            if not callable(getattr(data, "state_dict", None)) or not hasattr(data, "set_epoch"):
                raise ConfigError(
                    f"CheckpointCallback(data={data!r}): pass the vertexrt.data reader (open_dataset(...)), "
                    "not a tf.data.Dataset; train on ckpt.as_tf(batch_size)"
                )
            self._reader = _readers[manager] = _ReadPosition(data)

    def as_tf(self, batch_size: int, output_signature: Any = None) -> tf.data.Dataset:
        """The reader as an endless `tf.data.Dataset` of `batch_size` records (the global batch), whose place
        this callback checkpoints; call `restore(model)` first. Pass
        `steps_per_epoch=ckpt.steps_per_epoch(batch_size)` to `fit` (without it `fit` refuses to start).

        Under a `tf.distribute` strategy every worker trains on its own reader's records (the dataset carries
        `AutoShardPolicy.OFF`: the reader is sharded already) and each step takes `batch_size / replicas`
        records from each replica's share.

        Example:
            >>> train = ckpt.as_tf(256).map(lambda b: (b["x"], b["label"]))
        """
        if self._reader is None:
            raise ConfigError("CheckpointCallback.as_tf: construct the callback with data=<vertexrt reader>")
        if self._restored is None:
            raise ConfigError(
                "CheckpointCallback.as_tf: call ckpt.restore(model) first, so the data starts where the "
                "checkpoint stopped"
            )
        if batch_size < 1:
            raise ConfigError(f"CheckpointCallback.as_tf(batch_size={batch_size}): use a positive batch size")
        if output_signature is None:
            output_signature = self.data.as_tf().element_spec
        self._batch_size = batch_size
        options = tf.data.Options()
        options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.OFF
        records = tf.data.Dataset.from_generator(self._reader.records, output_signature=output_signature)
        return records.batch(batch_size, drop_remainder=True).with_options(options)

    def steps_per_epoch(self, batch_size: int) -> int:
        """Global batches of `batch_size` in one data epoch of the reader: `fit(steps_per_epoch=...)` for
        `as_tf(batch_size)`, whose stream has no end (an epoch of `fit` then is about one pass over the data).

        Needs a reader whose epoch length is known: `equalize` in force (the default with several workers;
        `open_dataset(..., equalize="drop_remainder")` on one).

        Example:
            >>> model.fit(ckpt.as_tf(64), epochs=5, steps_per_epoch=ckpt.steps_per_epoch(64))
        """
        from vertexrt.distributed import world_info

        if self._reader is None:
            raise ConfigError(
                "CheckpointCallback.steps_per_epoch: construct the callback with data=<vertexrt reader>"
            )
        length = self.data.epoch_length()
        if length is None:
            raise ConfigError(
                f"CheckpointCallback.steps_per_epoch: {self.data!r} does not know its epoch length; open it "
                "with equalize='drop_remainder' (its length is then counted once), or pass your own "
                "steps_per_epoch to fit"
            )
        workers = world_info().world_size  # each worker trains on batch_size / workers of its records
        if batch_size < workers or batch_size % workers:
            raise ConfigError(
                f"CheckpointCallback.steps_per_epoch(batch_size={batch_size}): the global batch must split "
                f"evenly over the {workers} workers; use a multiple of {workers}"
            )
        return max(1, length // (batch_size // workers))

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
        if self._reader is not None:
            if "data" not in restored:
                raise CheckpointError(
                    f"checkpoint step {self.manager.restored_step} in {self.manager.directory} holds no data "
                    "reader position (it was saved without CheckpointCallback(data=...)): resume it without "
                    "data=, or start a new checkpoint directory"
                )
            place = restored["data"]
            self._reader.seek(int(place["epoch"]), int(place["records"]), position.step)
        if saved["steps_per_epoch"] and position.batch >= saved["steps_per_epoch"]:
            position = Position(position.epoch + 1, 0, position.step)  # saved after an epoch's last batch
        logger.info("Keras resumes at epoch %d, batch %d", position.epoch, position.batch)
        _last_saved[self.manager] = position.step
        self._restored = self.position = position
        self._resume_pending = True
        return position

    def on_train_begin(self, logs: dict[str, Any] | None = None) -> None:
        position = self.restore(self.model)
        if self._reader is not None:
            if self._batch_size is None:
                raise ConfigError(
                    "CheckpointCallback(data=...): train on ckpt.as_tf(batch_size), the dataset whose place "
                    "the callback tracks"
                )
            strategy = self.model.distribute_strategy
            if strategy.num_replicas_in_sync > 1 and not self.data.equalized:
                raise ConfigError(
                    f"CheckpointCallback(data={self.data!r}): with several workers every reader must yield "
                    "the same number of records; open it with equalize='drop_remainder' (or 'auto')"
                )
            self._reader.per_step = _records_per_step(strategy, self._batch_size)
            if not (getattr(self, "params", None) or {}).get("steps"):
                raise ConfigError(
                    "CheckpointCallback(data=...): ckpt.as_tf(batch_size) has no end, so fit would never end "
                    "an epoch; pass fit(..., steps_per_epoch=ckpt.steps_per_epoch(batch_size))"
                )
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
        audit.event("epoch_end", step=self.position.step, epoch=epoch)  # for `local-run --chaos`
        if self.save_at_epoch_end:
            self._save(logs, force=True)

    def on_train_end(self, logs: dict[str, Any] | None = None) -> None:
        _watchdog().stop()  # what follows fit (evaluation, export) has no batches to beat
        if isinstance(getattr(self.model, "_training_state", None), _ResumeAt):
            self.model._training_state = None
        self.manager.wait()


class PreemptionCallback(_Tracked):
    """On SIGTERM: save a checkpoint at the next batch boundary and exit with status 143 (128 + SIGTERM).

    Subscribes to the process-wide preemption notice (`vertexrt.preemption.signals`) for the duration of
    `fit`. The workers agree through `vertexrt.preemption.vote.StopVote`: under a multi-worker strategy an
    all-reduce of the flag (~3 ms on CPU) every `check_every` steps, so they all stop at the same batch.
    The exit skips the rest of the epoch (validation would eat the grace period); with `exit=False`,
    `fit` stops after the epoch instead and `preempted` is True.
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
        self._notice: Subscription | None = None
        self._vote = StopVote()
        self._multi_worker = False

    def on_train_begin(self, logs: dict[str, Any] | None = None) -> None:
        if self._notice is None:
            self._notice = preemption_signal().subscribe()
        strategy = self.model.distribute_strategy
        self._multi_worker = isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy)
        if self._multi_worker:
            agree = _agreement(strategy)
            self._vote = StopVote(reduce=lambda local: int(agree(tf.constant(int(local))).numpy()) > 0)

    def on_train_batch_end(self, batch: int, logs: dict[str, Any] | None = None) -> None:
        super().on_train_batch_end(batch, logs)
        if self.preempted:
            return
        if self._multi_worker and self.position.step % self.check_every:
            return  # every worker takes part in the same all-reduces
        if not self._vote(self._notice is not None and self._notice.requested):
            return
        logger.warning("preemption: saving step %d and stopping training", self.position.step)
        self._save(logs, force=True)
        self.manager.wait()
        self.preempted = True
        self.model.stop_training = True
        if self.exit:
            self.manager.close()
            self._release()
            raise SystemExit(PREEMPTED_EXIT_CODE)

    def on_train_end(self, logs: dict[str, Any] | None = None) -> None:
        _watchdog().stop()
        self._release()

    def _release(self) -> None:
        notice, self._notice = self._notice, None
        if notice is not None:
            notice.close()


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


def _on_main_thread() -> bool:
    import threading

    return threading.current_thread() is threading.main_thread()


def _is_number(value: Any) -> bool:
    try:
        float(value)
    except (TypeError, ValueError):
        return False
    return True


def _records_per_step(strategy: Any, batch_size: int) -> int:
    """Records of its own reader this worker trains on per step: its replicas' part of the global batch."""
    replicas = strategy.num_replicas_in_sync
    try:
        local = len(strategy.extended.worker_devices)
    except RuntimeError:  # the default strategy: one replica
        local = 1
    if batch_size % replicas:
        raise ConfigError(
            f"CheckpointCallback.as_tf(batch_size={batch_size}): the global batch must split evenly over the "
            f"{replicas} replicas; use a multiple of {replicas}"
        )
    return batch_size // replicas * local


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


class TensorBoard(tf.keras.callbacks.TensorBoard):  # type: ignore[misc, name-defined]
    """Keras's `TensorBoard` callback for a `gs://` or `/gcs/` log dir (default `AIP_TENSORBOARD_LOG_DIR`).

    Keras writes its event files to a local staging directory and vertexrt uploads what each file gained
    (never a whole file again) every `upload_interval` seconds and at the end of `fit`: Keras's own
    callback cannot write `gs://` against an emulator (TensorFlow's GCS filesystem has Google's endpoints
    built in) and appends many small writes to Cloud Storage or the FUSE mount, which is slow. Only the chief
    uploads; other workers write to a temporary directory that is removed. Other keyword arguments are
    Keras's (`histogram_freq`, `update_freq`, `profile_batch`, ...).

    Example:
        >>> model.fit(train, epochs=5, callbacks=[vk.TensorBoard(update_freq=100)])
    """

    def __init__(self, log_dir: str | None = None, *, upload_interval: float = 60.0, **kwargs: Any) -> None:
        from vertexrt import tensorboard

        self.uploader = tensorboard.writer(log_dir, backend="files", upload_interval=upload_interval)
        self._scratch = None if self.uploader.enabled else tempfile.mkdtemp(prefix="vertexrt-tensorboard-")
        self._notice: Subscription | None = None
        super().__init__(log_dir=self.uploader.local_dir or self._scratch, **kwargs)

    def on_train_begin(self, logs: dict[str, Any] | None = None) -> None:
        super().on_train_begin(logs)
        if self._notice is None and self.uploader.enabled and _on_main_thread():
            # Open until on_train_end, which a preempted fit never reaches: the writer's close at exit then
            # still sees the notice and bounds the last upload (tensorboard.PREEMPTED_UPLOAD_SECONDS).
            self._notice = preemption_signal().subscribe()

    def on_train_end(self, logs: dict[str, Any] | None = None) -> None:
        super().on_train_end(logs)
        notice, self._notice = self._notice, None
        if self.uploader.enabled and not (notice is not None and notice.requested):
            self.uploader.flush()  # upload what this fit wrote (after a notice: at exit, bounded)
        if notice is not None:
            notice.close()
        elif self._scratch is not None:
            shutil.rmtree(self._scratch, ignore_errors=True)


@contextlib.contextmanager
def export_dir(uri: str | None = None) -> Iterator[str]:
    """A fresh local directory to save the model in on every worker; the chief's is uploaded to `uri`.

    Under `MultiWorkerMirroredStrategy` every worker must call `model.save()` (saving reads the mirrored
    variables collectively; a chief saving alone hangs), but only one copy may land in the model directory.
    On leaving the block the chief's directory is copied to `uri` (default `AIP_MODEL_DIR`: `gs://`,
    `/gcs/` or local) through `vertexrt.paths.upload`; every worker's directory is then removed.

    Example:
        >>> with vk.export_dir() as local:
        ...     model.save(os.path.join(local, "model.keras"))
        ...     tokenizer.save(os.path.join(local, "tokenizer.json"))
    """
    from vertexrt import paths
    from vertexrt.distributed import world_info

    if uri is None:
        from vertexrt.env import environment

        uri = environment().model_dir
    local = tempfile.mkdtemp(prefix="vertexrt-export-")
    try:
        yield local
        if world_info().is_chief:
            written = paths.upload(local, uri)
            logger.info("exported %d files to %s", len(written), uri)
    finally:
        shutil.rmtree(local, ignore_errors=True)


def export(model: Any, uri: str | None = None, *, filename: str | None = None) -> str:
    """Export `model` on every worker; the chief's copy lands in `uri` (default `AIP_MODEL_DIR`). Returns
    where it lands. Call it on every worker (see `export_dir`).

    By default a SavedModel for serving (`model.export`: the `serving_default` signature Vertex AI's
    prebuilt TensorFlow serving containers call) is written at the top of `uri`, where Vertex looks for
    `saved_model.pb`. It holds the traced graph, not Python code, so Lambda layers need no unsafe reload.
    `filename="model.keras"` (or `.h5`) saves the Keras file instead, with `model.save`; any other
    `filename` names a SavedModel subdirectory. When the Keras file cannot be written (a Lambda layer
    closing over a module: "cannot pickle 'module' object"), a SavedModel is written in its place with a
    warning, so a finished training is never lost to the export.

    Example:
        >>> vk.export(model)  # doctest: +SKIP
        'gs://my-bucket/output/model'
        >>> vk.export(model, filename="model.keras")  # doctest: +SKIP
        'gs://my-bucket/output/model/model.keras'
    """
    from vertexrt import paths
    from vertexrt.env import environment

    target = uri if uri is not None else environment().model_dir
    with export_dir(target) as local:
        if filename is None or not filename.endswith(_KERAS_FILES):
            _saved_model(model, local if filename is None else os.path.join(local, filename))
            landed = target if filename is None else paths.join(target, filename)
        else:
            landed = paths.join(target, _keras_file(model, local, filename))
    return landed


_KERAS_FILES = (".keras", ".h5")


def _keras_file(model: Any, local: str, filename: str) -> str:
    """`model.save(local/filename)`, or a SavedModel named after it when Keras cannot serialise the model;
    returns the name written."""
    try:
        model.save(os.path.join(local, filename))
        return filename
    except (TypeError, ValueError, NotImplementedError) as exc:  # e.g. "cannot pickle 'module' object"
        stem = os.path.splitext(filename)[0]
        logger.warning(
            "could not save %s (%s: %s): exporting a SavedModel named %s instead",
            filename,
            type(exc).__name__,
            exc,
            stem,
        )
        with contextlib.suppress(FileNotFoundError):
            os.remove(os.path.join(local, filename))  # a partial file
        _saved_model(model, os.path.join(local, stem))
        return stem


def _saved_model(model: Any, directory: str) -> None:
    """`model.export(directory)`: an inference SavedModel; Keras's printed summary goes to DEBUG."""
    import io

    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        model.export(directory)
    logger.debug("%s", printed.getvalue().strip())

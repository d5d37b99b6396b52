"""The Hugging Face ``transformers.Trainer`` on Vertex AI through vertexrt.

:class:`VertexTrainerCallback` (one object, three lines in a training script):

- :meth:`~VertexTrainerCallback.training_arguments`: ``TrainingArguments`` fields from the Vertex
  environment (``output_dir``, CPU/GPU, DDP backend), after joining ``torch.distributed`` from vertexrt's
  cluster model (``CLUSTER_SPEC``, torchrun, ``local-run``): the Trainer itself reads none of them.
- Checkpoints: the Trainer writes ``checkpoint-N`` to a local directory; on each save every rank copies its
  files to ``<output_dir>/checkpoint-N`` (``gs://``, ``/gcs/`` or local) and rank 0 writes a completion
  marker *last*, listing every rank's files with their sizes, once one listing of the step shows them all.
  :meth:`~VertexTrainerCallback.resume_from_checkpoint` is the newest step with a marker whose files check
  out (the Trainer resumes without a missing RNG or optimizer file, and says so only at INFO level).
- Preemption: on SIGTERM (through :func:`vertexrt.preemption.signals.preemption_signal`, the one owner) all
  ranks agree at a step end (:class:`~vertexrt.preemption.vote.StopVote`), save, commit, and exit 143.
- Hyperparameter tuning: rank 0 reports ``metric_for_best_model`` after each evaluation.
- Exact data on resume is the Trainer's own (a per-epoch seeded sampler, the batches already trained on
  skipped): a WARNING when training starts with ``ignore_data_skip=True``, which turns that off.

Example:
    >>> vertex = VertexTrainerCallback()
    >>> args = TrainingArguments(**vertex.training_arguments(), save_steps=100, data_seed=0)
    >>> trainer = Trainer(model=model, args=args, train_dataset=ds, callbacks=[vertex])
    >>> trainer.train(resume_from_checkpoint=vertex.resume_from_checkpoint())   # None on a fresh start
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import re
import shutil
import tempfile
from typing import Any

from transformers import TrainerCallback

from vertexrt import audit, paths
from vertexrt.checkpoint.resuming import log_resuming
from vertexrt.distributed import collectives
from vertexrt.errors import CheckpointError, ConfigError

log = logging.getLogger(__name__)

__all__ = ["MARKER", "VertexTrainerCallback", "export_model", "setup_distributed"]

#: Written into ``checkpoint-N`` last, once every rank's files are there: a step without it is incomplete.
#: ``{"step": N, "files": {"<name relative to checkpoint-N>": <bytes>, ...}}``; a marker of vertexrt before
#: the file list has ``step`` only.
MARKER = "vertexrt-complete.json"
_CHECKPOINT = re.compile(r"^checkpoint-(\d+)$")
_MARKER_LIMIT = 8 << 20  # bytes: ~100 k file names; a larger marker is not one vertexrt wrote
_FILES_LIMIT = 100_000


def setup_distributed() -> Any:
    """Join ``torch.distributed`` for a multi-process job and export torchrun's variables for the Trainer.

    ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT`` are
    set per *process* from :func:`vertexrt.distributed.cluster` (Vertex sets ``RANK``/``WORLD_SIZE`` per
    replica), then :func:`vertexrt.distributed.init_torch` joins the group with its patient rendezvous;
    accelerate (under the Trainer) finds it initialised. One process: nothing is set. Returns the cluster.

    Example:
        >>> c = setup_distributed()        # before TrainingArguments(...) is built
    """
    from vertexrt.distributed import cluster, init_torch

    c = cluster()
    if c.world_size > 1:
        host, _, port = (c.rendezvous_address or "").rpartition(":")
        os.environ.update(
            RANK=str(c.rank),
            WORLD_SIZE=str(c.world_size),
            LOCAL_RANK=str(c.local_rank),
            LOCAL_WORLD_SIZE=str(c.local_world_size),
            MASTER_ADDR=host.strip("[]") or "127.0.0.1",
            MASTER_PORT=port or os.environ.get("MASTER_PORT", ""),
        )
        init_torch()
    return c


def export_model(trainer: Any, uri: str | None = None) -> str:
    """``trainer.save_model`` to ``uri`` (default ``AIP_MODEL_DIR``), ``gs://`` and ``/gcs/`` included.

    Every rank must call it (the Trainer gathers sharded weights); the chief uploads. Returns ``uri``.

    Example:
        >>> export_model(trainer)          # gs://bucket/job/model/{config.json,model.safetensors}
    """
    from vertexrt.env import environment

    uri = (uri or environment().model_dir).rstrip("/")
    if paths.storage_kind(uri) == "local":
        trainer.save_model(uri)
        return uri
    with tempfile.TemporaryDirectory(prefix="vertexrt-hf-model-") as local:
        trainer.save_model(local)
        if trainer.is_world_process_zero():
            paths.upload(local, uri)
        _barrier()
    return uri


class VertexTrainerCallback(TrainerCallback):
    """Preemption-safe checkpoints in ``output_dir``, resumption and hypertune for ``transformers.Trainer``.

    Args:
        output_dir: where committed checkpoints live (local, ``/gcs/...`` or ``gs://...``); default
            ``vertexrt.env.environment().checkpoint_dir`` (``AIP_CHECKPOINT_DIR``).
        staging_dir: the local directory the Trainer writes to when ``output_dir`` is not local (default: a
            new one under the system temp dir, private to this process and removed at its exit); ignored for a
            local ``output_dir``. Each rank uploads all of its copy of a step, so
            :meth:`resume_from_checkpoint` first removes the ``checkpoint-*`` an earlier job left there.
        metric: the hyperparameter-tuning metric tag; default ``TrainingArguments.metric_for_best_model``.

    Example:
        >>> vertex = VertexTrainerCallback("gs://bucket/run/checkpoints")
        >>> trainer = Trainer(model, TrainingArguments(**vertex.training_arguments()), callbacks=[vertex])
    """

    def __init__(
        self, output_dir: str | None = None, *, staging_dir: str | None = None, metric: str | None = None
    ) -> None:
        if output_dir is None:
            from vertexrt.env import environment

            output_dir = environment().checkpoint_dir
        self.output_dir = str(output_dir).rstrip("/")
        self.remote = paths.storage_kind(self.output_dir) != "local"
        self._staging = staging_dir
        self.metric = metric
        self._preemption: Any = None  # a vertexrt.preemption.vote.PreemptionAgreement while training
        self._stopping = False  # the next save is the preemption save: exit 143 after it
        self._after_epoch = False  # the notice came at an epoch's last step: save after the epoch's end

    @property
    def local_dir(self) -> str:
        """Where the Trainer writes (``TrainingArguments.output_dir``): ``output_dir`` itself when local."""
        if not self.remote:
            return self.output_dir
        if self._staging is None:
            # never a path derived from output_dir: every job on the machine writing there shared it (and
            # every run of one test), and each uploaded the checkpoint files the others had left in it
            from vertexrt.distributed import world_info

            self._staging = tempfile.mkdtemp(prefix=f"vertexrt-hf-rank{world_info().rank}-")
            atexit.register(shutil.rmtree, self._staging, True)
        return self._staging

    def training_arguments(self, **overrides: Any) -> dict[str, Any]:
        """``TrainingArguments`` keyword arguments for this job, ``overrides`` last.

        Joins ``torch.distributed`` first (:func:`setup_distributed`) so accelerate sees the job's world.
        ``ddp_find_unused_parameters`` is False unless overridden (a model with parameters that get no
        gradient in some steps needs ``True``). Sets ``TENSORBOARD_LOGGING_DIR`` (read by the Trainer's
        TensorBoard reporter) to ``AIP_TENSORBOARD_LOG_DIR`` when it is a local or ``/gcs/`` path.

        Example:
            >>> TrainingArguments(**vertex.training_arguments(per_device_train_batch_size=8))
        """
        import torch

        from vertexrt.env import environment

        c = setup_distributed()
        logs = environment().tensorboard_log_dir
        if paths.storage_kind(logs) != "gcs":
            os.environ.setdefault("TENSORBOARD_LOGGING_DIR", logs)
        fields: dict[str, Any] = {
            "output_dir": self.local_dir,
            "use_cpu": not torch.cuda.is_available(),
            # HF's default (True) walks the graph for unused parameters every step and warns about it
            "ddp_find_unused_parameters": False,
        }
        if c.world_size > 1:
            fields["ddp_backend"] = "nccl" if torch.cuda.is_available() else "gloo"
        fields.update(overrides)
        return fields

    # -- resumption ---------------------------------------------------------------------------------

    def complete_steps(self) -> list[int]:
        """The steps under ``output_dir`` whose completion marker is present and names them, sorted."""
        return sorted(self._committed())

    def _committed(self) -> dict[int, dict[str, Any]]:
        """Each committed step's marker (those present, readable and naming their step)."""
        fs, root = paths.filesystem(self.output_dir)
        if not fs.exists(root):
            return {}
        markers = {}
        for entry in fs.ls(root, detail=False):
            found = _CHECKPOINT.match(str(entry).rstrip("/").rsplit("/", 1)[-1])
            if found:
                marker = self._read_marker(int(found.group(1)))
                if marker is not None and marker.get("step") == int(found.group(1)):
                    markers[int(found.group(1))] = marker
        return markers

    def resume_from_checkpoint(self) -> str | None:
        """The newest complete checkpoint as a local directory for ``trainer.train(resume_from_checkpoint=)``,
        downloaded from ``output_dir`` when that is remote; None on a fresh start. Call it on every rank,
        before training: with a remote ``output_dir`` it first empties the staging dir of ``checkpoint-*``.

        A committed step whose files differ from its marker's list (one missing, or of another size) is
        skipped with a WARNING naming it and the file, for the newest older one that checks out.

        Raises:
            CheckpointError: steps are committed but none checks out (delete ``output_dir`` to start over).
        """
        if self.remote:
            self._clear_staging()
        step = self._usable_step()
        if step is None:
            return None
        name = f"checkpoint-{step}"
        audit.event("resume", step=step)
        if not self.remote:
            return log_resuming(
                paths.join(self.output_dir, name), step, result=paths.join(self.output_dir, name)
            )
        local = os.path.join(self.local_dir, name)
        paths.download(paths.join(self.output_dir, name), local)
        log_resuming(paths.join(self.output_dir, name), step, f"downloaded to {local}")
        return local

    def _usable_step(self) -> int | None:
        """The newest committed step whose files match its marker: rank 0 lists and checks (each process
        by itself without torch.distributed), the others receive its answer.

        Raises:
            CheckpointError: on every rank, when steps are committed but none checks out (as
                :mod:`vertexrt.checkpoint` does: a damaged newest step falls back to an older one, never to a
                fresh start over damaged ones).
        """
        dist = collectives.torch_dist()
        answer: tuple[int | None, str | None] = (None, None)
        if dist is None or dist.get_rank() == 0:
            try:
                answer = self._newest_verified()
            except Exception as exc:  # every rank waits for the answer: send the failure instead
                answer = (None, f"reading the checkpoints in {paths.redact(self.output_dir)} failed: {exc!r}")
        step, error = collectives.broadcast(answer, dist)
        if error is not None:
            raise CheckpointError(error)
        return step

    def _newest_verified(self) -> tuple[int | None, str | None]:
        committed = self._committed()
        damaged = []
        for step in sorted(committed, reverse=True):
            files = committed[step].get("files")
            if files is None:  # committed by a vertexrt before the file list: resumed unchecked, as then
                return step, None
            problem = self._check_files(step, files)
            if problem is None:
                return step, None
            log.warning(
                "not resuming from checkpoint-%d in %s: %s; trying the committed step before it",
                step, paths.redact(self.output_dir), problem,
            )  # fmt: skip
            damaged.append(f"checkpoint-{step}: {problem}")
        if damaged:
            return None, (
                f"no usable checkpoint in {paths.redact(self.output_dir)}: {'; '.join(damaged)}. Delete the "
                "directory to start over"
            )
        return None, None

    def _check_files(self, step: int, files: Any) -> str | None:
        """What differs between ``checkpoint-<step>``'s marker ``files`` and one listing of the step; None
        when every listed file is there with its size."""
        if (
            not isinstance(files, dict)
            or len(files) > _FILES_LIMIT
            or not all(_valid_name(n) and type(v) is int and v >= 0 for n, v in files.items())
        ):
            return f"{MARKER} holds no valid file list (names under the step, sizes in bytes)"
        return _difference(files, _listing(paths.join(self.output_dir, f"checkpoint-{step}")))

    def _clear_staging(self) -> None:
        """Remove the ``checkpoint-*`` copies in the staging directory (an earlier job's, or a partial
        download): a save of that step would upload them with its own files, as this job's."""
        if not os.path.isdir(self.local_dir):
            return
        for entry in os.listdir(self.local_dir):
            if _CHECKPOINT.match(entry):
                shutil.rmtree(os.path.join(self.local_dir, entry), ignore_errors=True)

    def _read_marker(self, step: int) -> dict[str, Any] | None:
        marker = paths.join(self.output_dir, f"checkpoint-{step}", MARKER)
        try:
            with paths.open(marker, "rb") as f:
                data = f.read(_MARKER_LIMIT + 1)
            if len(data) > _MARKER_LIMIT:
                raise ValueError(f"over {_MARKER_LIMIT} bytes")
            value = json.loads(data)
        except FileNotFoundError:
            return None
        except Exception as exc:  # a torn or foreign marker: the step is not complete
            log.warning("ignoring checkpoint-%d: unreadable marker %s (%s)", step, paths.redact(marker), exc)
            return None
        return value if isinstance(value, dict) else None

    # -- Trainer events -------------------------------------------------------------------------------

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if os.path.abspath(args.output_dir) != os.path.abspath(self.local_dir):
            raise ConfigError(
                f"VertexTrainerCallback: TrainingArguments(output_dir={args.output_dir!r}) but the callback "
                f"expects {self.local_dir!r}; build the arguments with "
                "TrainingArguments(**callback.training_arguments(...))"
            )
        from vertexrt.preemption.vote import PreemptionAgreement

        if args.ignore_data_skip:
            log.warning(
                "VertexTrainerCallback: TrainingArguments(ignore_data_skip=True) makes a resume mid-epoch "
                "train on the epoch's first batches again; a preemption will not resume exactly: leave it "
                "False"
            )
        self._preemption = PreemptionAgreement()
        self._stopping = self._after_epoch = False

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        audit.step(state.global_step)  # `local-run --chaos` counts steps and places faults here
        if self._preemption is None or not self._preemption():
            return
        if state.epoch is not None and float(state.epoch).is_integer():
            # an epoch's last step: the epoch's evaluation (and the random draw its DataLoader takes) comes
            # before the save, as in an uninterrupted run (a periodic save at this step does not exit yet)
            log.warning("preemption notice: saving checkpoint-%d after this epoch's end", state.global_step)
            self._after_epoch = True
            return
        log.warning("preemption notice: saving checkpoint-%d, then exiting", state.global_step)
        self._stopping = True
        control.should_save = True
        control.should_training_stop = True

    def on_epoch_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self._after_epoch:
            self._stopping = True
            control.should_save = True
            control.should_training_stop = True

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        try:
            self._commit(state.global_step, state.is_world_process_zero, args.save_total_limit)
        except BaseException:
            self._release()  # training ends here without on_train_end: give the SIGTERM subscription back
            raise
        if self._stopping:
            from vertexrt.preemption.signals import PREEMPTED_EXIT_CODE

            log.warning("checkpoint-%d committed: exiting %d", state.global_step, PREEMPTED_EXIT_CODE)
            self._release()
            raise SystemExit(PREEMPTED_EXIT_CODE)

    def on_evaluate(self, args: Any, state: Any, control: Any, metrics: Any = None, **kwargs: Any) -> None:
        tag = self.metric or args.metric_for_best_model
        if tag is None or not state.is_world_process_zero:
            return
        metrics = metrics or {}
        key = tag if tag in metrics else f"eval_{tag}"
        if key not in metrics:
            self._release()  # the error ends training without on_train_end
            raise ConfigError(
                f"VertexTrainerCallback: metric {tag!r} (metric_for_best_model) is not among the evaluation "
                f"metrics {sorted(metrics)}; name one of them"
            )
        from vertexrt import hypertune

        hypertune.report(tag, float(metrics[key]), step=state.global_step)

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._release()

    # -- internals ------------------------------------------------------------------------------------

    def _commit(self, step: int, chief: bool, keep: int | None) -> None:
        name = f"checkpoint-{step}"
        target = paths.join(self.output_dir, name)
        if self.remote:
            if chief:
                self._remove_marker(step)  # un-commit a step saved again before its files change
            local = os.path.join(self.local_dir, name)
            if os.path.isdir(local):
                paths.upload(local, target)  # rank 0: weights, optimizer, state; each rank: its RNG state
        _barrier()  # every rank's files are in place
        dist = collectives.torch_dist()
        # remote: each rank's own copy, as uploaded; local: one directory that every rank wrote into
        mine = _local_files(os.path.join(self.local_dir, name)) if self.remote or chief else {}
        everyone = collectives.gather(mine, dist)
        files: dict[str, int] = {}
        problem = None
        if everyone is not None:
            try:
                files = merge_file_lists(everyone)
                problem = _difference(files, _listing(target))
            except CheckpointError as exc:
                problem = str(exc)
            except Exception as exc:  # every rank waits for the verdict: send the failure instead
                problem = f"listing {paths.redact(target)} failed: {exc!r}"
        problem = collectives.broadcast(problem, dist)
        if problem is not None:
            raise CheckpointError(
                f"checkpoint-{step} not committed to {paths.redact(self.output_dir)}: {problem}"
            )
        if chief:
            with paths.open(paths.join(target, MARKER), "wb") as f:
                f.write(json.dumps({"step": step, "files": files}).encode())
            if self.remote and keep:
                for old in self.complete_steps()[:-keep]:
                    self._remove_marker(old)
                    fs, root = paths.filesystem(paths.join(self.output_dir, f"checkpoint-{old}"))
                    fs.rm(root, recursive=True)
        _barrier()  # nobody exits before the marker is written
        audit.event("commit", step=step)
        log.info("committed %s", paths.redact(target))

    def _remove_marker(self, step: int) -> None:
        fs, marker = paths.filesystem(paths.join(self.output_dir, f"checkpoint-{step}", MARKER))
        if fs.exists(marker):
            fs.rm(marker)

    def _release(self) -> None:
        preemption, self._preemption = self._preemption, None
        if preemption is not None:
            preemption.close()


def merge_file_lists(per_rank: list[dict[str, int]]) -> dict[str, int]:
    """One step's files (relative name → bytes) from every rank's list, in rank order.

    Raises:
        CheckpointError: two ranks wrote one name with different sizes (the upload that came last won).

    Example:
        >>> merge_file_lists([{"model.safetensors": 90, "rng_state_0.pth": 14}, {"rng_state_1.pth": 14}])
        {'model.safetensors': 90, 'rng_state_0.pth': 14, 'rng_state_1.pth': 14}
    """
    files: dict[str, int] = {}
    for rank, listed in enumerate(per_rank):
        for name, size in listed.items():
            if files.setdefault(name, size) != size:
                raise CheckpointError(
                    f"rank {rank} wrote {name} with {size} bytes, another rank with {files[name]}: each file "
                    "of a step must come from one rank (or be the same on every rank)"
                )
    return dict(sorted(files.items()))


def _local_files(folder: str) -> dict[str, int]:
    """The files under a local ``folder`` (relative name → bytes), the completion marker left out."""
    files = {}
    for where, _, names in os.walk(folder):
        for entry in names:
            full = os.path.join(where, entry)
            files[os.path.relpath(full, folder).replace(os.sep, "/")] = os.path.getsize(full)
    files.pop(MARKER, None)
    return files


def _listing(uri: str) -> dict[str, int]:
    """The objects under ``uri`` (relative name → bytes), from one fresh listing."""
    fs, root = paths.filesystem(uri)
    root = root.rstrip("/")
    fs.invalidate_cache(root)
    found = fs.find(root, detail=True)
    return {
        path[len(root) + 1 :]: int(info["size"])
        for path, info in found.items()
        if path.startswith(root + "/")
    }


def _difference(files: dict[str, int], found: dict[str, int]) -> str | None:
    """The first file of ``files`` missing from ``found`` or of another size there, said; None if none."""
    for name, size in sorted(files.items()):
        if name not in found:
            return f"{name} is missing (committed with {size} bytes)"
        if found[name] != size:
            return f"{name} has {found[name]} bytes, not the {size} committed"
    return None


def _valid_name(name: Any) -> bool:
    return (
        isinstance(name, str)
        and name != MARKER
        and all(part not in ("", ".", "..") for part in name.split("/"))
    )


def _barrier() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()

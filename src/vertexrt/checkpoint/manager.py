"""CheckpointManager: policy-driven, atomic, asynchronous, preemption-aware checkpoints of any state tree.

Example:
    >>> from vertexrt.checkpoint import CheckpointManager, EveryNSteps, KeepLast, rng_state
    >>> state = {"model": model, "opt": opt, "step": 0, "rng": rng_state()}
    >>> with CheckpointManager("gs://bucket/run/ckpt", save_policy=EveryNSteps(500),
    ...                        keep_policy=KeepLast(3)) as mgr:
    ...     restored = mgr.restore(target=state)          # None on a fresh start
    ...     start = restored["step"] + 1 if restored else 0
    ...     for step in range(start, total):
    ...         train_step()
    ...         state["step"] = step
    ...         mgr.save(step, state, metrics={"loss": loss})
"""

from __future__ import annotations

import logging
import operator
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from types import TracebackType
from typing import Any

from vertexrt import audit
from vertexrt.checkpoint import (
    dcp,
    restoring,
    save_metrics,
    serialization,
    shard_restore,
    step_writer,
    storage,
    tokens,
)
from vertexrt.checkpoint.after_commit import AfterCommit
from vertexrt.checkpoint.decision import SaveDecision
from vertexrt.checkpoint.manifest import FORMAT, FORMAT_VERSION
from vertexrt.checkpoint.policies import (
    EveryNSteps,
    KeepLast,
    KeepPolicy,
    LastSave,
    SavePolicy,
    observe_save_cost,
)
from vertexrt.checkpoint.preemption_watch import PreemptionWatch
from vertexrt.checkpoint.resuming import log_resuming
from vertexrt.checkpoint.retention import Retention
from vertexrt.checkpoint.tiers import attach as fast_tier
from vertexrt.checkpoint.tiers.config import FastTier
from vertexrt.distributed import collectives
from vertexrt.errors import CheckpointCorruptError, CheckpointError, ConfigError, StepExistsError
from vertexrt.phases import long_phase

log = logging.getLogger(__name__)

__all__ = ["FORMAT", "FORMAT_VERSION", "CheckpointManager", "StepExistsError"]


class CheckpointManager:
    """Saves and restores training state under ``directory`` (local path, ``/gcs/...`` or ``gs://...``).

    Args:
        directory: where the ``step_<N>`` directories live; default ``environment().checkpoint_dir``.
        save_policy: when ``save()`` really saves (default ``EveryNSteps(1)``: every call). With several
            ranks, a clock-based policy is rank 0's decision, applied on every rank a few calls later.
        keep_policy: which committed steps survive (default ``KeepLast(3)``; the newest is always kept).
        async_save: snapshot on the caller's thread, write on a background thread (one save in flight).
        rank, world_size: this process's place; default ``vertexrt.distributed.world_info()``.
        allow_pickle: pickle objects that are not tensors/arrays/JSON values (and unpickle them on restore).
        save_on_preemption: subscribe to the preemption notice now (see :meth:`save_on_preemption`).
        stale_after: seconds after which another host's unfinished save counts as abandoned.
        commit_timeout: seconds the chief waits for every rank's shard before giving up a sharded save.
        fast: a fast tier under this one (local disk + peer copies, ``vertexrt.checkpoint.FastTier``);
            default from ``VERTEXRT_FAST_CHECKPOINT_EVERY`` / ``_PEERS``, else none.
    """

    def __init__(
        self,
        directory: str | None = None,
        save_policy: SavePolicy | None = None,
        keep_policy: KeepPolicy | None = None,
        async_save: bool = True,
        rank: int | None = None,
        world_size: int | None = None,
        *,
        allow_pickle: bool = False,
        save_on_preemption: bool = False,
        stale_after: float = 600.0,
        commit_timeout: float = 1800.0,
        fast: FastTier | None = None,
    ) -> None:
        if directory is None:
            from vertexrt.env import environment

            directory = environment().checkpoint_dir
        self.directory = str(directory)
        self.save_policy: SavePolicy = save_policy if save_policy is not None else EveryNSteps(1)
        self.keep_policy: KeepPolicy = keep_policy if keep_policy is not None else KeepLast(3)
        for name, policy, method in (
            ("save_policy", self.save_policy, "should_save"),
            ("keep_policy", self.keep_policy, "keep"),
        ):
            if not callable(getattr(policy, method, None)):
                raise ConfigError(f"CheckpointManager({name}={policy!r}): it needs a {method}() method")
        self.async_save = async_save
        self.allow_pickle = allow_pickle
        self.commit_timeout = commit_timeout
        self.rank, self.world_size = collectives.resolve(rank, world_size)
        if not 0 <= self.rank < self.world_size:
            raise ConfigError(f"CheckpointManager: rank {self.rank} is outside world_size {self.world_size}")
        self._strategy = storage.strategy_for(self.directory, stale_after)
        self._retention = Retention(self._strategy, self.keep_policy, self._manifest)
        self._after_commit = AfterCommit(self._strategy, self._retention)  # rank 0: retire, retention
        self._site = step_writer.Site(
            self.directory, self._strategy, self.rank, self.world_size, committed=self._after_commit
        )
        self._writer_group: Any = None  # the gloo group of the writer thread's collectives (sharded saves)
        self._decide_policy = SaveDecision(self.save_policy, self.world_size)
        self._start = time.time()
        self._last: tuple[int | None, float | None] = (None, None)  # (step, time) of the previous save
        self._writer: ThreadPoolExecutor | None = None  # one long-lived writer thread, made on first use
        self._pending: Future[None] | None = None  # the save in flight
        self._committed_once = False  # the first commit is logged at INFO, the routine ones at DEBUG
        self._staging: Any = None
        self._preemption = PreemptionWatch()
        self._closed = False
        self.restored_step: int | None = None
        if self.rank == 0:
            removed = self._strategy.cleanup() + self._retention.sweep()
            if removed:
                log.info("removed unfinished checkpoint leftovers in %s: %s", self.directory, removed)
        self._fast = fast_tier.attach(fast, self._site, allow_pickle=allow_pickle)
        if save_on_preemption:
            self.save_on_preemption()

    # -- reading -------------------------------------------------------------------------------------------

    def all_steps(self) -> list[int]:
        """Committed steps, oldest first (not verified; see :meth:`latest_step`)."""
        self._after_commit.join()
        return self._strategy.committed_steps()

    def latest_step(self) -> int | None:
        """The newest committed step whose manifest reads and whose data files are all present, or None."""
        self._raise_finished_error()
        self._after_commit.join()
        for step in reversed(self._strategy.committed_steps()):
            try:
                restoring.check_files(self._strategy, step, self._manifest(step))
                return step
            except CheckpointCorruptError as exc:
                log.warning("checkpoint step %d in %s is unusable: %s", step, self.directory, exc)
        return None

    def metadata(self, step: int) -> dict[str, Any]:
        """A committed step's manifest fields (``step``, ``time``, ``metrics``, ``frameworks``, ...)."""
        return {k: v for k, v in self._manifest(step).items() if k != "shards"}

    def restore(
        self, target: Any = None, step: int | None = None, shard: int | None = None, *, device: Any = None
    ) -> Any:
        """Load the newest valid checkpoint (or ``step``); returns None when there is none.

        With ``target`` (a state tree of live objects), modules, optimizers, tensors, arrays, TF variables,
        Keras models and ``state_dict`` objects are loaded in place and the returned tree holds them; other
        values are returned as read. All bytes are read and checksummed before anything is loaded. On local
        disk, returned tensors/arrays are views of a private copy-on-write memory map of the data files
        (writable; writes never reach the checkpoint; valid after the step is deleted).

        A corrupt or incomplete step is skipped with a warning naming the file, and the previous committed
        step is tried (not when ``step`` is given: then the error is raised). With torch.distributed, every
        rank must call ``restore()``: the ranks restore the same step, the newest that is valid on all of
        them. A sharded step written by a different number of ranks is the same error on every rank.
        ``shard`` (default: this rank for sharded checkpoints) picks the per-rank shard. Torch tensors come
        back on ``device`` (e.g. ``"cuda"``, ``"cpu"``) when given; without it and without ``target``, on
        the device they were saved from, or on the CPU with a warning when this machine lacks it.

        Raises:
            CheckpointError: no step could be read, a newer format, a different world size for a sharded
                checkpoint, or the target does not match.
        """
        self.wait()
        fast = fast_tier.newest(self._fast, self._strategy, target) if step is None else None
        loaded: restoring.Loaded | None
        if fast is not None:
            loaded = fast
        elif dcp.holds_dtensors(target):  # sharded (DTensor) state: DCP reshards onto this world
            return self._restored_through_dcp(target, step)
        elif step is not None:
            # read once, for the routing and the load
            manifest = restoring.read_manifest(self._strategy, step)
            if dcp.written_here(manifest):
                return self._restored_through_dcp(target, step)
            loaded = restoring.load(
                self._strategy,
                step,
                rank=self.rank,
                world_size=self.world_size,
                shard=shard,
                allow_pickle=self.allow_pickle,
                manifest=manifest,
            )
        else:
            found = restoring.newest(
                self._strategy,
                rank=self.rank,
                world_size=self.world_size,
                shard=shard,
                allow_pickle=self.allow_pickle,
                dist=collectives.torch_dist() if self.world_size > 1 else None,
                through_dcp=dcp.written_here,
            )
            if isinstance(found, restoring.DcpStep):  # the newest usable step was written through DCP
                return self._restored_through_dcp(target, None)
            loaded = found
        if loaded is None:
            return None
        result = restoring.decode(loaded, target, device)
        if step is None:  # the newest step: a resume (the Trainer and Lightning name their step and log)
            log_resuming(self.directory if fast is None else str(self.fast_directory), loaded.step)
        self._resumed(loaded.step)
        return result

    # -- writing -------------------------------------------------------------------------------------------

    def save(
        self,
        step: int,
        state: Any,
        metrics: Mapping[str, float] | None = None,
        force: bool = False,
        shard: int | None = None,
        overwrite: bool = False,
    ) -> bool:
        """Save ``state`` as ``step`` if the save policy (or ``force``) says so; returns whether it saves.

        Every rank calls it. Replicated state is written by rank 0 only; with ``shard=k`` every rank writes
        its own state as shard ``k`` and rank 0 commits once all shards are written. With ``async_save``
        the state is snapshotted before returning and written in the background; the next ``save``,
        ``wait`` or ``close`` re-raises a background failure. After a preemption notice saves are synchronous.

        A committed step is never replaced silently: saving it again raises :class:`StepExistsError`,
        unless ``overwrite=True``, which swaps in the new version atomically (the step stays committed
        throughout; the old version's files are deleted after the swap).
        """
        self._check_open()
        self._raise_finished_error()
        if isinstance(step, bool) or not hasattr(step, "__index__") or operator.index(step) < 0:
            raise ConfigError(f"save(step={step!r}): the step must be an integer >= 0")
        step = operator.index(step)
        if self._fast is not None and not self._fast.on_save(
            step, state, preempted=self._preemption.preempted
        ):
            return False  # an emergency save that would not fit in the grace period: fast tier only
        if not self._decide(step, force):
            return False
        with long_phase(f"checkpoint save of step {step}"):  # snapshot (and a blocking write): no hang
            return self._save_decided(step, state, metrics, shard, overwrite)

    def _save_decided(
        self, step: int, state: Any, metrics: Mapping[str, float] | None, shard: int | None, overwrite: bool
    ) -> bool:
        self.wait()
        if dcp.holds_dtensors(state):  # sharded (DTensor) state: every rank writes its shards via DCP
            dcp.save(self._site, step, state, save_metrics.read(save_metrics.snapshot(metrics)), overwrite)
            self._last = (step, time.time())
            return True
        dist = collectives.torch_dist()
        if shard is not None and self.world_size > 1 and dist is None:
            raise ConfigError(
                "save(shard=...) across processes needs torch.distributed initialised (e.g. "
                "vertexrt.distributed.init_torch()) so the ranks agree on one commit"
            )
        if shard is None and self.rank != 0:
            self._last = (step, time.time())
            return True
        if shard is not None:  # rank 0 says whether the step exists, with the token (one broadcast)
            token = step_writer.agree_to_start(self._site, step, overwrite=overwrite, dist=dist)
            if dist is not None and self.world_size > 1 and self._writer_group is None:
                self._writer_group = collectives.thread_group(dist, self.commit_timeout)  # every rank, here
        elif not overwrite and self._strategy.is_committed(step):
            raise StepExistsError(
                f"step {step} is already committed in {self.directory}; pass overwrite=True to save(...) to "
                "replace it atomically, or save a new step number"
            )
        else:
            token = tokens.new_token()
        tree, leaves = serialization.encode(state, allow_pickle=self.allow_pickle)
        nodes = [node for node, _ in leaves]
        clean_metrics = save_metrics.snapshot(metrics)
        self._last = (step, time.time())
        blocking = not self.async_save or self._preemption.preempted or self._preemption.arrived_here()
        encoded = [enc for _, enc in leaves]
        buffers = self._stager().stage(encoded, copy_host=False) if blocking else self._snapshot(encoded)
        args = (step, tree, nodes, buffers, clean_metrics, token, shard, overwrite)
        audit.event("save", step=step, asynchronous=not blocking)
        if blocking:
            self._write(*args)
        else:
            if self._writer is None:
                self._writer = ThreadPoolExecutor(1, thread_name_prefix="vertexrt-checkpoint-writer")
            self._pending = self._writer.submit(self._write, *args)
        return True

    def wait(self) -> None:
        """Block until the save in flight is committed (and the fast tier's step with its peer copies);
        re-raise its error if it failed."""
        pending, self._pending = self._pending, None
        try:
            if pending is not None:
                pending.result()
        finally:
            self._after_commit.join()
        if self._fast is not None:
            self._fast.wait()

    def close(self) -> None:
        """Finish the save in flight and retention, release the preemption notice, free the snapshot."""
        if self._closed:
            return
        try:
            self.wait()
        finally:
            self._closed = True
            if self._fast is not None:
                self._fast.close()
            if self._staging is not None:  # the stager: its copy threads and pinned arena
                self._staging.close()
                self._staging = None
            if self._writer is not None:
                self._writer.shutdown(wait=True)
            self._after_commit.close()
            for drain in (self._decide_policy.drain, self._preemption.drain):
                try:
                    drain()
                except Exception as exc:  # e.g. the process group is gone already
                    log.debug("draining a collective at close: %s", exc)
            self._preemption.close()
            if self._writer_group is not None:  # destroyed now: one left to interpreter teardown can abort
                group, self._writer_group = self._writer_group, None
                try:
                    collectives.torch_dist().destroy_process_group(group)  # type: ignore[union-attr]
                except Exception as exc:  # the default group (and with it this one) is gone already
                    log.debug("destroying the checkpoint writer's group: %s", exc)

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if exc is None:
            self.close()
            return
        try:  # do not hide the exception that is already propagating
            self.close()
        except Exception as error:
            log.error("the checkpoint save in flight failed too: %s", error)

    # -- preemption ----------------------------------------------------------------------------------------

    def save_on_preemption(self) -> None:
        """Subscribe to the process-wide SIGTERM notice (``vertexrt.preemption.signals``); idempotent.

        Poll :meth:`preemption_requested` at step boundaries; when True, ``save(step, state, force=True)``
        (synchronous from then on), ``close()`` and exit with status 143 (128 + SIGTERM).
        """
        self._preemption.subscribe()

    def preemption_requested(self) -> bool:
        """True once SIGTERM arrived on any rank; all ranks must call it at the same points.

        With torch.distributed the ranks agree one call after the notice (a non-blocking vote), so they
        all see True at the same call.
        """
        return self._preemption.requested()

    # -- one step into several sub-trees (the Trainer's restore) ---------------------------------------------

    def restore_shards(
        self, step: int, parts: Sequence[tuple[Any, int | None]], *, device: Any = None
    ) -> list[Any]:
        """Load ``step`` into each ``(target, shard)`` of ``parts`` (shard None: this rank's, or the one
        body of a replicated step); the decoded trees, in order. Every rank calls it together.

        Rank 0 alone reads the step's manifest and lists its files; each rank receives the header and the
        bodies of its own parts (one object gather, one scatter), then reads and checksums their data
        (:mod:`vertexrt.checkpoint.shard_restore`).

        Raises:
            CheckpointCorruptError: the step is damaged (on every rank when rank 0 found it so).
            CheckpointError: a sharded step written by another number of ranks, a newer format, a step
                written through DCP, or reading failed on rank 0.
        """
        self.wait()
        results = shard_restore.restore(
            self._site, step, parts, allow_pickle=self.allow_pickle, device=device
        )
        self._resumed(step)
        return results

    # -- the fast tier (vertexrt.checkpoint.tiers) ----------------------------------------------------------

    @property
    def fast_directory(self) -> str | None:
        """This VM's directory of the fast tier (None without one)."""
        return None if self._fast is None else str(self._fast.directory)

    def restore_fast_shards(
        self, parts: Sequence[tuple[Any, int | None]], *, device: Any = None
    ) -> tuple[list[Any], bool] | None:
        """Load the fast tier's newest step that every rank can get into ``parts`` (``(target, shard)``:
        shard None or this rank for this rank's own state, 0 for rank 0's, which rank 0 broadcasts: its
        tree in one object broadcast, its bytes as raw tensors; :mod:`vertexrt.checkpoint.tiers.attach`); the
        decoded trees in order, and whether the durable tier holds that step too. None when there is no
        fast tier or no fast step as new as the durable tier's newest (then :meth:`restore_shards` a
        durable step). Every rank calls it together.

        Raises:
            ConfigError: a part asks for another rank's state than rank 0's.
            CheckpointError: the fast tier failed on some rank for a reason other than a damaged copy.
        """
        fast_tier.check_parts(parts, self.rank)
        if self._fast is None:
            return None
        self.wait()
        found = fast_tier.newest_with_durable(self._fast, self._strategy)
        if found is None:
            return None
        own, in_durable = found
        self.restored_step = own.step  # named by the Trainer's error when the decoding below fails
        restored = fast_tier.decode_parts(
            own, in_durable, parts, rank=self.rank, world_size=self.world_size, device=device
        )
        self._resumed(own.step)
        return restored

    # -- internals -----------------------------------------------------------------------------------------

    def _resumed(self, step: int) -> None:
        """``step`` was restored: the save policy counts from it."""
        self.restored_step = step
        audit.event("resume", step=step)
        self._last = (step, None)

    def _decide(self, step: int, force: bool) -> bool:
        last_step, last_time = self._last
        last = LastSave(step=last_step, time=last_time, now=time.time(), start_time=self._start)
        decision = self._decide_policy(step, last, rank=self.rank, dist=collectives.torch_dist)
        return force or decision

    def _restored_through_dcp(self, target: Any, step: int | None) -> Any:
        restored = dcp.restore(self._site, target, step)
        if restored is None:
            return None
        self.restored_step = restored.step
        self._last = (restored.step, None)
        return restored.value

    def _snapshot(self, encoded: list[Any]) -> list[Any]:
        """Private host copies of the leaves (GPU leaves: enqueued, see ``staging``), in one reused arena."""
        return self._stager().stage(encoded, copy_host=True)

    def _stager(self) -> Any:
        from vertexrt.checkpoint.staging import Stager

        if self._staging is None:
            self._staging = Stager()
        return self._staging

    def _write(
        self,
        step: int,
        tree: Any,
        nodes: list[dict[str, Any]],
        buffers: list[Any],
        metrics: dict[str, Any],
        token: str,
        shard: int | None,
        overwrite: bool,
    ) -> None:
        together = shard is not None and self.world_size > 1
        began = time.monotonic()
        with fast_tier.durable_write(self._fast, buffers):  # the fast tier's measure of the durable rate
            written = step_writer.write(
                self._site,
                step,
                token,
                shard=shard,
                nodes=nodes,
                buffers=buffers,
                tree=tree,
                metrics=save_metrics.read(metrics),  # device metrics: read here, after the state's copies
                overwrite=overwrite,
                dist=collectives.torch_dist() if together else None,
                group=self._writer_group if together else None,
            )
        observe_save_cost(self.save_policy, time.monotonic() - began)  # YoungDaly learns the save cost
        if written is None:  # a rank other than 0: its shard is in the committed step
            return
        if self._committed_once:
            log.debug("checkpoint step %d committed in %s", step, self.directory)
        else:
            self._committed_once = True
            log.info(
                "checkpoint step %d committed in %s (later commits are logged at DEBUG)", step, self.directory
            )
        audit.event("commit", step=step)

    def _manifest(self, step: int) -> dict[str, Any]:
        return restoring.read_manifest(self._strategy, step)

    def _raise_finished_error(self) -> None:
        if self._pending is not None and self._pending.done():
            self.wait()

    def _check_open(self) -> None:
        if self._closed:
            raise CheckpointError(f"the CheckpointManager for {self.directory} is closed")

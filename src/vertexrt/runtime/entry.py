"""``@vertexrt.main``: the entry point of a training script on Vertex AI, under local-run, or torchrun.

It reads the environment and the cluster, sets up replica-prefixed logging, subscribes to the preemption
notice, runs the preflight checks of ``vertexrt doctor`` (a fatal finding exits 1 with its fix, before the
function runs), logs the contract checks of ``vertexrt info`` as warnings, parses the arguments, initialises
distributed training for the framework, picks the device, and calls the function with a ``Context``.
Outcomes: the function's return value (exit 0); the user's exception re-raised with the replica named;
``SystemExit(143)`` (128 + SIGTERM) after a preemption, so that the platform restarts the replica and it
resumes. A SIGTERM the function never asked about (``ctx.should_stop()``) is logged loudly, a few seconds
after it arrived and again at the end, and the process exits 143 rather than report success.

Example:
    >>> import argparse, vertexrt
    >>> parser = argparse.ArgumentParser()
    >>> _ = parser.add_argument("--epochs", type=int, default=3)
    >>> @vertexrt.main(framework="torch", parser=parser)
    ... def train(ctx: vertexrt.Context, args):
    ...     ...
    >>> if __name__ == "__main__":
    ...     train()
"""

from __future__ import annotations

import functools
import logging
import os
import time
import traceback
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar, cast, overload

from vertexrt import audit
from vertexrt.env import CRASH_LOOP_EXIT_CODE
from vertexrt.errors import ConfigError
from vertexrt.preemption.signals import PREEMPTED_EXIT_CODE, UnpolledWatch, preemption_signal
from vertexrt.runtime import attempts
from vertexrt.runtime.context import Context, checked_fast_tier
from vertexrt.runtime.logs import setup_logging

if TYPE_CHECKING:
    import argparse

    from vertexrt.checkpoint import FastTier

logger = logging.getLogger(__name__)

FRAMEWORKS = ("torch", "tf", None)

R = TypeVar("R")

#: Seconds an unpolled preemption notice waits before the first warning (Vertex kills ~15 s after SIGTERM).
UNPOLLED_WARNING_AFTER = 3.0


class Preempted(SystemExit):
    """Raised after a preemption checkpoint was saved: the process exits 143 and the replica restarts.

    A ``SystemExit``, so a script without ``@main`` also exits 143 without a traceback.
    """

    def __init__(self, step: int | None = None) -> None:
        super().__init__(PREEMPTED_EXIT_CODE)
        self.step = step


@overload
def main(fn: Callable[..., R]) -> Callable[..., R]: ...


@overload
def main(
    fn: None = None,
    *,
    framework: str | None = None,
    parser: argparse.ArgumentParser | None = None,
    ignore_unknown_args: bool = False,
    log_level: int | str = logging.INFO,
    log_all_ranks: bool = False,
    preflight: bool = True,
    strategy: str = "auto",
    legacy_keras: bool | None = None,
    fast: FastTier | None = None,
) -> Callable[[Callable[..., R]], Callable[..., R]]: ...


def main(
    fn: Callable[..., R] | None = None,
    *,
    framework: str | None = None,
    parser: argparse.ArgumentParser | None = None,
    ignore_unknown_args: bool = False,
    log_level: int | str = logging.INFO,
    log_all_ranks: bool = False,
    preflight: bool = True,
    strategy: str = "auto",
    legacy_keras: bool | None = None,
    fast: FastTier | None = None,
) -> Any:
    """Decorate the training function ``fn(ctx)`` or ``fn(ctx, args)``.

    Args:
        framework: ``"torch"`` (process group + device), ``"tf"`` (a ``tf.distribute`` strategy, created
            before anything else touches TensorFlow) or ``None`` (no framework).
        parser: parsed with ``vertexrt.hypertune.parse_args`` (``--name=value``, ``"256.0"`` ints,
            ``--job-dir``); the namespace is passed as ``args`` and kept in ``ctx.args``.
        ignore_unknown_args: warn about unknown flags instead of exiting.
        log_level: the chief's log level; other ranks log WARNING and above unless ``log_all_ranks``.
        preflight: run ``vertexrt.doctor.preflight`` (output dirs writable, mounts, credentials, data, GPUs,
            ...) before the function; a fatal finding logs it with its fix and exits 1. ``False`` skips it.
        strategy, legacy_keras: for ``framework="tf"``, passed to ``vertexrt.distributed.setup_tensorflow``:
            ``strategy="multi_worker_mirrored"`` etc.; ``legacy_keras=True`` makes ``tf.keras`` tf-keras,
            which ``model.fit`` under MultiWorkerMirroredStrategy needs on TF 2.21 (Keras 3 fails there
            with "Attempt to convert a value (PerReplica...)"); ``False`` keeps Keras 3 without a warning.
        fast: the fast checkpoint tier of ``ctx.checkpoints`` (``vertexrt.checkpoint.FastTier``: local disk
            every few steps, plus a copy on a peer VM). It wins over ``VERTEXRT_FAST_CHECKPOINT_EVERY`` /
            ``_PEERS``, which apply when it is None. A ``Trainer(ctx)`` uses it too.

    The decorated function takes an optional ``argv`` (default ``sys.argv[1:]``).

    Example:
        >>> @vertexrt.main(framework="tf", legacy_keras=True)  # doctest: +SKIP
        ... def train(ctx): ...

    Raises:
        ConfigError: an unknown ``framework``, TensorFlow options without it, or ``fast`` not a ``FastTier``.
    """
    fast = checked_fast_tier(fast, "@vertexrt.main(fast=...)")
    if framework not in FRAMEWORKS:
        raise ConfigError(f"@vertexrt.main(framework={framework!r}): use 'torch', 'tf' or None")
    if framework != "tf" and (strategy != "auto" or legacy_keras is not None):
        raise ConfigError(
            f"@vertexrt.main(strategy={strategy!r}, legacy_keras={legacy_keras!r}) are TensorFlow options: "
            "add framework='tf', or remove them"
        )
    tf_options = {"strategy": strategy, "legacy_keras": legacy_keras}

    def decorate(user_fn: Callable[..., R]) -> Callable[..., R]:
        wants_args = _takes_two_arguments(user_fn)

        @functools.wraps(user_fn)
        def run(argv: Sequence[str] | None = None) -> R:
            return _run(
                user_fn,
                wants_args,
                argv,
                framework=framework,
                parser=parser,
                ignore_unknown_args=ignore_unknown_args,
                log_level=log_level,
                log_all_ranks=log_all_ranks,
                preflight=preflight,
                tf_options=tf_options,
                fast=fast,
            )

        return run

    return decorate(fn) if fn is not None else decorate


def _takes_two_arguments(fn: Callable[..., Any]) -> bool:
    import inspect

    params = [
        p
        for p in inspect.signature(fn).parameters.values()
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.VAR_POSITIONAL)
    ]
    return len(params) >= 2 or any(p.kind is p.VAR_POSITIONAL for p in params)


def _run(
    user_fn: Callable[..., R],
    wants_args: bool,
    argv: Sequence[str] | None,
    *,
    framework: str | None,
    parser: argparse.ArgumentParser | None,
    ignore_unknown_args: bool,
    log_level: int | str,
    log_all_ranks: bool,
    preflight: bool,
    tf_options: dict[str, Any],
    fast: FastTier | None,
) -> R:
    ctx = Context.create(framework, fast=fast)
    undo_logging = _setup_logging(ctx, log_level, log_all_ranks)
    owns_process_group = failed = False
    notice, watch = preemption_signal(), None
    try:
        ctx.install_preemption_handler()  # before the slow parts: from now on a SIGTERM sets a flag
        watch = UnpolledWatch(notice, after=UNPOLLED_WARNING_AFTER, warn=_warn_unpolled_now)
        if preflight:
            _preflight(ctx)
        ctx._preflighted = True  # run, or declined: the Trainer does not run it again
        if parser is not None:
            from vertexrt import hypertune

            ctx.args = hypertune.parse_args(parser, argv, ignore_unknown=ignore_unknown_args)
        rank = ctx.rank
        ctx.watchdog.start()  # before the process group: torch's flight recorder then records collectives
        owns_process_group = _init_framework(ctx, tf_options)
        if ctx.rank != rank:  # torch.distributed's rank is authoritative: relabel the log lines
            undo_logging()
            undo_logging = _setup_logging(ctx, log_level, log_all_ranks)
        ctx.metrics.is_chief = ctx.is_chief
        _log_banner(ctx)
        if ctx.is_chief and not preflight:  # the preflight checks include these
            _log_contract_warnings(ctx)
        guard = attempts.guard(ctx.env.checkpoint_dir, rank=ctx.rank, replica=ctx.replica, job=ctx.env.job_id)
        if guard is not None:
            ctx.watchdog.judge = guard.hung  # a hang after the same step twice is a loop too
        try:
            result: R | None = user_fn(ctx, ctx.args) if wants_args else user_fn(ctx)
        except Preempted:
            result, ctx._preempted = None, True  # the Trainer saved the checkpoint before raising
        except Exception as err:
            failed = True  # the other ranks may be stuck in a collective: tear down without waiting
            where = f"replica {ctx.replica} (rank {ctx.rank} of {ctx.world_size})"
            if notice.unpolled and not ctx.preempted:
                _warn_unpolled_at_exit(notice.arrived_at, "then raised (its error follows)")
            logger.error("%s failed: %s: %s", where, type(err).__name__, err)
            if hasattr(err, "add_note"):  # Python >= 3.11: shown under the traceback
                err.add_note(f"vertexrt: raised on {where}")
            if guard is not None:
                _judge(guard, err, preempting=notice.requested)
            raise
        manager = ctx._checkpoints
        if manager is not None:
            manager.wait()
        if guard is not None and (ctx.preempted or notice.requested):
            guard.preempted(audit.last_step())
        if ctx.preempted:
            logger.warning(
                "preempted: checkpoint saved in %s; exiting %d so the replica restarts and resumes",
                manager.directory if manager is not None else ctx.env.checkpoint_dir,
                PREEMPTED_EXIT_CODE,
            )
            raise Preempted()
        if notice.requested:  # SIGTERM arrived and the function returned anyway: not a success
            if notice.unpolled:
                _warn_unpolled_at_exit(
                    notice.arrived_at,
                    f"returned; exiting {PREEMPTED_EXIT_CODE} (not 0) so Vertex restarts the replica",
                )
            else:
                logger.warning(
                    "a preemption notice (SIGTERM) arrived and the training function returned: exiting %d "
                    "so the replica restarts and resumes",
                    PREEMPTED_EXIT_CODE,
                )
            raise Preempted()
        if ctx.is_chief and ctx.env.on_vertex:
            _warn_if_nothing_exported(ctx.env.model_dir, trial=ctx.env.trial_id)
        logger.info("done; model dir %s", ctx.env.model_dir)
        return cast(R, result)
    finally:
        if watch is not None:
            watch.stop()
        if ctx._watchdog is not None:
            ctx._watchdog.judge = None
        try:
            ctx.close(drain=not failed)
            if owns_process_group and failed:
                from vertexrt.distributed.torch import mark_failed

                mark_failed()  # peers may be mid-collective: no teardown at exit either
            elif owns_process_group:
                _destroy_process_group()
        finally:
            undo_logging()


def _judge(guard: attempts.CrashLoopGuard, err: Exception, *, preempting: bool) -> None:
    """Record the failure ``err`` with the crash-loop guard; exit 93 when it repeats the previous attempt's.
    A failure after the preemption notice (raised while the job is torn down) is recorded as a preemption."""
    step = audit.last_step()
    if preempting:
        guard.preempted(step)
        return
    message = guard.failed(err, step)
    if message is not None:
        traceback.print_exception(err)
        logger.error("%s", message)
        raise SystemExit(CRASH_LOOP_EXIT_CODE) from err


def _setup_logging(ctx: Context, level: int | str, all_ranks: bool) -> Callable[[], None]:
    return setup_logging(
        rank=ctx.rank,
        replica=ctx.replica,
        is_chief=ctx.is_chief,
        json_lines=_json_logs(ctx),
        level=level,
        all_ranks=all_ranks,
        labels={"trial": ctx.env.trial_id} if ctx.env.trial_id else None,
    )


_NEVER_POLLED = (
    "the training function never checked ctx.should_stop() (nor CheckpointManager.preemption_requested())"
)
_HOW_TO_FIX = (
    "check ctx.should_stop() after every step and, when it is True, save a checkpoint and return "
    "(vertexrt.Trainer does this)"
)


def _warn_unpolled_now(waited: float) -> None:
    logger.warning(
        "SIGTERM (the preemption notice) arrived %.0f s ago and %s: nothing is being saved, and Vertex kills "
        "the replica ~15 s after the notice; %s",
        waited,
        _NEVER_POLLED,
        _HOW_TO_FIX,
    )


def _warn_unpolled_at_exit(arrived_at: float | None, outcome: str) -> None:
    when = time.strftime("%H:%M:%S", time.localtime(arrived_at)) if arrived_at is not None else "?"
    logger.warning(
        "SIGTERM arrived at %s and %s: nothing was saved at the notice. The function %s; the replica resumes "
        "from its last checkpoint. To lose nothing, %s",
        when,
        _NEVER_POLLED,
        outcome,
        _HOW_TO_FIX,
    )


def _log_contract_warnings(ctx: Context) -> None:
    """The checks of ``vertexrt info`` (output directories, project), as warnings, on Vertex only."""
    if not ctx.env.on_vertex:
        return
    from vertexrt.doctor import contract_warnings

    for warning in contract_warnings():
        logger.warning("vertexrt: %s", warning)


def _preflight(ctx: Context) -> None:
    """``vertexrt.doctor.preflight``; a fatal finding is logged once, with its fix, and exits 1."""
    from vertexrt import doctor
    from vertexrt.errors import PreflightError

    try:
        doctor.preflight(ctx.env, ctx.cluster)
    except PreflightError as err:
        logger.error("replica %s (rank %d of %d): %s", ctx.replica, ctx.rank, ctx.world_size, err)
        raise SystemExit(1) from err


def _warn_if_nothing_exported(model_dir: str, *, trial: str | None = None) -> None:
    """A job whose model dir stays empty usually saved its model on the container's disk, which is lost.

    A hyperparameter-tuning trial (``trial``) often saves no model on purpose: then it is an INFO line.
    """
    from vertexrt import paths

    try:
        fs, path = paths.filesystem(model_dir)
        empty = not fs.exists(path) or not fs.ls(path)
    except Exception as err:  # a listing problem must not fail a finished job
        logger.debug("could not list %s: %s", model_dir, err)
        return
    if empty:
        logger.log(
            logging.INFO if trial else logging.WARNING,
            "nothing was written to the model directory %s (AIP_MODEL_DIR): files saved elsewhere in the "
            "container are lost when the job ends; write the model there (Trainer.export gets this path)",
            model_dir,
        )


def _json_logs(ctx: Context) -> bool:
    """``$VERTEXRT_LOG_FORMAT`` (``json`` / ``text``), else JSON lines inside a real Vertex job."""
    chosen = os.environ.get("VERTEXRT_LOG_FORMAT", "").strip().lower()
    if chosen in ("json", "text"):
        return chosen == "json"
    if chosen:
        raise ConfigError(f"VERTEXRT_LOG_FORMAT={chosen!r}: use 'json' or 'text' (or unset it)")
    return ctx.env.on_vertex and not os.environ.get("VERTEXRT_LOCAL_RUN")


def _init_framework(ctx: Context, tf_options: dict[str, Any]) -> bool:
    """Set up distributed training and the device; return True when a torch process group was created."""
    if ctx.framework == "torch":
        import torch.distributed as dist

        from vertexrt.distributed import init_torch

        was_up = dist.is_available() and dist.is_initialized()
        handle = init_torch()
        ctx.rank, ctx.world_size, ctx.local_rank = handle.rank, handle.world_size, handle.local_rank
        ctx.device = handle.device
        return not was_up and dist.is_initialized()
    if ctx.framework == "tf":
        from vertexrt.distributed import setup_tensorflow

        ctx.strategy = setup_tensorflow(**tf_options)
        preemption_signal().reassert()  # TF's multi-worker runtime takes SIGTERM at the C level on start
        from vertexrt.runtime.profiling import start_tf_profiler_server

        start_tf_profiler_server()  # on AIP_TF_PROFILER_PORT when Vertex asks for it
    return False


def _destroy_process_group() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


def _log_banner(ctx: Context) -> None:
    env = ctx.env
    logger.info(
        "vertexrt: %s job=%s trial=%s replica=%s rank=%d/%d device=%s",
        env.platform,
        env.job_id or "-",
        env.trial_id or "-",
        ctx.replica,
        ctx.rank,
        ctx.world_size,
        ctx.device,
    )
    logger.info(
        "vertexrt: model_dir=%s checkpoint_dir=%s tensorboard_log_dir=%s",
        env.model_dir,
        env.checkpoint_dir,
        env.tensorboard_log_dir,
    )

"""Profiling: torch profiler traces of a window of steps, and TensorFlow's profiler server.

``profile(steps=range(a, b))`` records steps ``a`` to ``b - 1`` with ``torch.profiler`` and writes the trace
where TensorBoard's profile plugin looks:
``<AIP_TENSORBOARD_LOG_DIR>/plugins/profile/<run>/<worker>.<ns>.pt.trace.json`` (the names
``torch.profiler.tensorboard_trace_handler`` gives). A ``gs://`` or ``/gcs/`` log directory is written
locally, then uploaded through ``vertexrt.paths``. Only the chief records unless ``all_ranks=True``. A
profiler that fails logs one WARNING and stops: profiling never fails training. Per step, ``step()`` is a
counter update and one comparison outside the window.

``start_tf_profiler_server()`` starts TensorFlow's profiler server on ``$AIP_TF_PROFILER_PORT`` (set by Vertex
for jobs with a TensorBoard instance), so that Vertex TensorBoard can capture a profile on demand.

Example:
    >>> with profile(steps=range(10, 15)) as prof:  # doctest: +SKIP
    ...     for batch in batches:
    ...         train_step(batch)
    ...         prof.step()  # or prof.step(global_step) after a resume
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from types import TracebackType
from typing import Any

logger = logging.getLogger(__name__)

TF_PROFILER_PORT_VARIABLE = "AIP_TF_PROFILER_PORT"
_tf_server_port: int | None = None  # TensorFlow's server cannot be started twice in a process


class StepProfiler:
    """Records the steps in ``steps`` with torch.profiler; see :func:`profile`."""

    def __init__(
        self,
        steps: range,
        *,
        log_dir: str | None = None,
        run: str | None = None,
        all_ranks: bool = False,
        start_step: int = 0,
        rank: int | None = None,
    ) -> None:
        if steps.step != 1 or len(steps) == 0:
            from vertexrt.errors import ConfigError

            raise ConfigError(f"profile(steps={steps!r}): give a non-empty range of consecutive steps")
        if rank is None:
            from vertexrt.distributed import world_info

            rank = world_info().rank
        self.steps = steps
        self.log_dir = log_dir
        self.run = run or f"steps_{steps.start}_{steps.stop}"
        self.rank = rank
        self.enabled = all_ranks or rank == 0
        self._done = start_step  # steps completed: the index of the next step to run
        self._profiler: Any = None
        self._stage: str | None = None

    @property
    def directory(self) -> str:
        """Where the traces go: ``<log dir>/plugins/profile/<run>``."""
        from vertexrt import paths

        log_dir = self.log_dir
        if log_dir is None:
            from vertexrt.env import environment

            log_dir = environment().tensorboard_log_dir
        return paths.join(log_dir, "plugins", "profile", self.run)

    def step(self, done: int | None = None) -> None:
        """Mark a step finished; ``done``: the number of steps finished so far (default: one more)."""
        self._done = self._done + 1 if done is None else done
        if self._profiler is not None:
            self._profiler.step()  # a ProfilerStep mark for the plugin's step view, inside the window only
        if self.enabled and (self._done == self.steps.start or self._done >= self.steps.stop):
            self._edge()

    def __enter__(self) -> StepProfiler:
        if self.enabled and self._done == self.steps.start:
            self._edge()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def close(self) -> None:
        """Stop and write a window that is still open (training ended inside it)."""
        if self._profiler is not None:
            self._guarded(self._finish)

    def _edge(self) -> None:
        if self._profiler is None and self._done == self.steps.start:
            self._guarded(self._start)
        elif self._profiler is not None and self._done >= self.steps.stop:
            self._guarded(self._finish)

    def _start(self) -> None:
        import torch
        from torch.profiler import ProfilerActivity, tensorboard_trace_handler

        from vertexrt import paths

        target = self.directory
        local = target if paths.storage_kind(target) == "local" else None
        if local is None:
            self._stage = local = tempfile.mkdtemp(prefix="vertexrt-profile-")
        os.makedirs(local, exist_ok=True)  # fail now, not after the window was recorded
        activities = [ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(ProfilerActivity.CUDA)
        handler = tensorboard_trace_handler(local, worker_name=f"rank{self.rank}")
        self._profiler = torch.profiler.profile(activities=activities, on_trace_ready=handler)
        self._profiler.start()
        logger.info("profiling steps %d-%d into %s", self.steps.start, self.steps.stop - 1, target)

    def _finish(self) -> None:
        profiler, self._profiler = self._profiler, None
        self.enabled = False  # one window per profiler
        profiler.stop()  # writes the trace through the handler
        if self._stage is not None:
            from vertexrt import paths

            paths.upload(self._stage, self.directory)
            shutil.rmtree(self._stage, ignore_errors=True)
            self._stage = None
        logger.info(
            "profile of steps %d-%d written to %s", self.steps.start, self.steps.stop - 1, self.directory
        )

    def _guarded(self, action: Any) -> None:
        try:
            action()
        except Exception as err:
            logger.warning(
                "profiling steps %d-%d failed and is off for this run (training goes on): %s: %s",
                self.steps.start,
                self.steps.stop - 1,
                type(err).__name__,
                err,
            )
            self.enabled = False
            self._profiler = None
            if self._stage is not None:
                shutil.rmtree(self._stage, ignore_errors=True)
                self._stage = None


def profile(
    steps: range,
    *,
    log_dir: str | None = None,
    run: str | None = None,
    all_ranks: bool = False,
    start_step: int = 0,
) -> StepProfiler:
    """A torch profiler for the steps in ``steps``; call ``step()`` after each training step.

    Args:
        steps: the steps to record, counted in finished steps (``range(10, 15)``: the 11th to 15th step).
        log_dir: the TensorBoard log directory; default ``$AIP_TENSORBOARD_LOG_DIR`` (or its local fallback).
        run: the run's directory under ``plugins/profile``; default ``steps_<a>_<b>``.
        all_ranks: record on every rank (one trace file per rank), not only the chief.
        start_step: steps already finished (after a resume), when ``step()`` is called without a number.

    Example:
        >>> with profile(steps=range(100, 105), start_step=restored_step) as prof:  # doctest: +SKIP
        ...     for step in range(restored_step + 1, total + 1):
        ...         train_step()
        ...         prof.step(step)
    """
    return StepProfiler(steps, log_dir=log_dir, run=run, all_ranks=all_ranks, start_step=start_step)


def start_tf_profiler_server() -> int | None:
    """Start TensorFlow's profiler server on ``$AIP_TF_PROFILER_PORT``; returns the port, or ``None``.

    Does nothing without the variable; a bad value or a failed start is logged, never raised.

    Example:
        >>> start_tf_profiler_server()  # doctest: +SKIP
        6009
    """
    global _tf_server_port
    text = os.environ.get(TF_PROFILER_PORT_VARIABLE, "").strip()
    if not text:
        return None
    if _tf_server_port is not None:
        return _tf_server_port
    if not (text.isdigit() and 0 < int(text) < 65536):
        logger.warning(
            "%s=%r is not a port number (1-65535): the TensorFlow profiler server is not started",
            TF_PROFILER_PORT_VARIABLE,
            text[:20],
        )
        return None
    try:
        import tensorflow as tf

        tf.profiler.experimental.server.start(int(text))
    except Exception as err:
        logger.warning(
            "the TensorFlow profiler server did not start on %s=%s (training goes on): %s: %s",
            TF_PROFILER_PORT_VARIABLE,
            text,
            type(err).__name__,
            err,
        )
        return None
    _tf_server_port = int(text)
    logger.info("TensorFlow profiler server listening on port %d", _tf_server_port)
    return _tf_server_port

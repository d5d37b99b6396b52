"""Training progress: steps/s, samples/s and ETA, as a tqdm bar when interactive or log lines otherwise.

``update()`` runs once per step and costs a counter increment and a clock read; the rates are
computed only when a line is due (every ``interval`` seconds).

Example:
    >>> p = Progress(total_steps=100, interval=60.0, bar=False)
    >>> for step in range(1, 101):
    ...     p.update(step, samples=32)
    >>> p.close()
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable, Mapping
from typing import Any

logger = logging.getLogger(__name__)


def format_eta(seconds: float) -> str:
    """``3725.2`` -> ``'1:02:05'``."""
    seconds = max(0, int(round(seconds)))
    hours, rest = divmod(seconds, 3600)
    return f"{hours}:{rest // 60:02d}:{rest % 60:02d}"


class Progress:
    """Throughput and ETA of a training loop.

    Args:
        total_steps: the step the run ends at, for the ETA and the bar (``None`` if unknown).
        start_step: the step the loop starts from (after a restore).
        interval: seconds between log lines.
        bar: ``True`` for a tqdm bar, ``False`` for log lines, ``None`` for a bar only when stderr is a
            terminal and tqdm is installed.
        enabled: ``False`` on non-chief ranks (nothing is printed, rates are still kept).
        on_log: called as ``on_log(step, {name: float})`` with the metrics of each line shown (e.g. to
            write them to TensorBoard): device values are read only at these intervals.
    """

    def __init__(
        self,
        *,
        total_steps: int | None = None,
        start_step: int = 0,
        interval: float = 30.0,
        bar: bool | None = None,
        enabled: bool = True,
        on_log: Callable[[int, dict[str, float]], None] | None = None,
    ) -> None:
        self.total_steps = total_steps
        self.interval = interval
        self.step = start_step
        self._enabled = enabled
        self._on_log = on_log
        self._logged_step: int | None = None
        self._start_step = start_step
        self._samples = 0
        self._metrics: Mapping[str, Any] | None = None
        self._t0 = time.monotonic()
        self._next = self._t0 + interval
        self._bar: Any = None
        if enabled and (bar or (bar is None and sys.stderr.isatty())):
            self._bar = _make_bar(total_steps, start_step)

    def set_total(self, total_steps: int | None) -> None:
        """Change the step the run ends at (e.g. once an epoch's length is known)."""
        self.total_steps = total_steps
        if self._bar is not None:
            self._bar.total = total_steps
            self._bar.refresh()

    def update(self, step: int, samples: int = 0, metrics: Mapping[str, Any] | None = None) -> None:
        """Record that ``step`` is done, consumed ``samples`` examples and returned ``metrics``.

        The metrics (e.g. ``{"loss": tensor}``) are converted to floats only when a line is shown.
        """
        self.step = step
        self._samples += samples
        self._metrics = metrics
        if self._bar is not None:
            self._bar.update(1)
        now = time.monotonic()
        if now >= self._next:
            self._next = now + self.interval
            self._emit(now)

    def rates(self) -> dict[str, float]:
        """``steps_per_s``, ``samples_per_s`` and ``eta_s`` (``-1`` when the end is unknown)."""
        elapsed = max(time.monotonic() - self._t0, 1e-9)
        steps_per_s = (self.step - self._start_step) / elapsed
        eta = -1.0
        if self.total_steps is not None and steps_per_s > 0:
            eta = max(self.total_steps - self.step, 0) / steps_per_s
        return {"steps_per_s": steps_per_s, "samples_per_s": self._samples / elapsed, "eta_s": eta}

    def line(self) -> str:
        """The progress line, e.g. ``step 120/1000 (12%) 85.3 steps/s 2730 samples/s ETA 0:00:10``."""
        r = self.rates()
        where = f"step {self.step}"
        if self.total_steps:
            where += f"/{self.total_steps} ({100 * self.step // self.total_steps}%)"
        text = f"{where} {r['steps_per_s']:.1f} steps/s {r['samples_per_s']:.0f} samples/s"
        if r["eta_s"] >= 0:
            text += f" ETA {format_eta(r['eta_s'])}"
        return f"{text} {self._metrics_text()}".rstrip()

    def _metric_values(self) -> dict[str, float]:
        values = {}
        for name, value in (self._metrics or {}).items():
            if callable(getattr(value, "detach", None)):  # a torch loss: no requires_grad warning
                value = value.detach()
            try:
                values[name] = float(value)
            except (TypeError, ValueError):
                continue
        return values

    def _metrics_text(self) -> str:
        return " ".join(f"{name}={value:.4g}" for name, value in self._metric_values().items())

    def _emit(self, now: float) -> None:
        if not self._enabled:
            return
        self._log_metrics()
        if self._bar is not None:
            r = self.rates()
            self._bar.set_postfix_str(
                f"{r['samples_per_s']:.0f} samples/s {self._metrics_text()}", refresh=False
            )
        else:
            logger.info(self.line())

    def _log_metrics(self) -> None:
        if self._on_log is not None and self._metrics is not None and self._logged_step != self.step:
            self._logged_step = self.step
            self._on_log(self.step, self._metric_values())

    def close(self) -> None:
        """Close the bar, or log a last line."""
        if self._enabled:
            self._log_metrics()
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        elif self._enabled:
            logger.info(self.line())


def _make_bar(total: int | None, initial: int) -> Any:
    try:
        from tqdm.auto import tqdm
    except ImportError:
        return None
    return tqdm(total=total, initial=initial, unit="step", dynamic_ncols=True)

"""The metrics reporter a ``Context`` carries: one call logs metrics and reports them to hypertune.

Reports go to the hyperparameter-tuning file from the chief only (``vertexrt.hypertune.report``), so a
training function can call it on every rank. The latest value of each metric is kept in ``latest``.

Example:
    >>> reporter = MetricsReporter(is_chief=True, hypertune=False)
    >>> reporter.report({"accuracy": 0.91, "loss": 0.3}, step=100)
    >>> reporter.latest["accuracy"]
    0.91
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

logger = logging.getLogger(__name__)


class MetricsReporter:
    """Logs metrics and reports them to the hyperparameter-tuning service.

    Args:
        is_chief: only the chief writes the hypertune file and logs the values.
        hypertune: report to ``vertexrt.hypertune`` (cloudml-hypertune's file); off makes it log-only.
    """

    def __init__(self, *, is_chief: bool, hypertune: bool = True) -> None:
        self.is_chief = is_chief
        self.hypertune = hypertune
        self.latest: dict[str, float] = {}

    def report(self, metrics: Mapping[str, float], step: int | None = None) -> None:
        """Record ``metrics`` at ``step``; raises ``ValueError`` (hypertune's ``MetricError``) on NaN/inf."""
        values = {tag: float(value) for tag, value in metrics.items()}
        if self.hypertune:
            from vertexrt import hypertune

            for tag, value in values.items():
                hypertune.report(tag, value, step=step)
        self.latest.update(values)
        if self.is_chief and values:
            shown = " ".join(f"{tag}={value:.6g}" for tag, value in values.items())
            logger.info("metrics at step %s: %s", step if step is not None else "-", shown)

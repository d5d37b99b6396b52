"""The training entry points: ``@main``, ``Context`` and the ``Trainer`` base class.

Example:
    >>> import vertexrt
    >>> @vertexrt.main(framework="torch")
    ... def train(ctx: vertexrt.Context) -> None:
    ...     MyTrainer(ctx, max_epochs=3).fit()
"""

from vertexrt.runtime.context import Context
from vertexrt.runtime.entry import PREEMPTED_EXIT_CODE, Preempted, main
from vertexrt.runtime.metrics import MetricsReporter
from vertexrt.runtime.progress import Progress
from vertexrt.runtime.trainer import Trainer

__all__ = ["PREEMPTED_EXIT_CODE", "Context", "MetricsReporter", "Preempted", "Progress", "Trainer", "main"]

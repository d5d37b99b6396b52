"""The Trainer's TensorBoard scalars: progress-line metrics as ``train/<name>``, evaluations as
``eval/<name>``.

Written from the chief to ``AIP_TENSORBOARD_LOG_DIR`` through ``vertexrt.tensorboard.writer(backend=
"scalars")``, which imports no framework: torch's own writer would load TensorFlow in every replica.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from vertexrt.errors import ConfigError

logger = logging.getLogger(__name__)


class TrainerScalars:
    """The scalars of one ``fit()``; ``open()`` gives None where nothing is written."""

    def __init__(self, writer: Any) -> None:
        self.writer = writer

    @classmethod
    def open(cls, log_dir: str, *, enabled: bool) -> TrainerScalars | None:
        """A writer for ``log_dir`` when ``enabled`` (the chief, ``tensorboard=True``) and it can be made."""
        if not enabled:
            return None
        from vertexrt import tensorboard

        try:
            return cls(tensorboard.writer(log_dir, backend="scalars", chief_only=False))
        except ConfigError as err:
            logger.info("no TensorBoard events written: %s", err)
            return None

    def train(self, step: int, metrics: Mapping[str, float]) -> None:
        self.writer.scalars({f"train/{name}": value for name, value in metrics.items()}, step)

    def evaluation(self, step: int, metrics: Mapping[str, float]) -> None:
        self.writer.scalars({f"eval/{name}": value for name, value in metrics.items()}, step)

    def close(self) -> None:
        self.writer.close()

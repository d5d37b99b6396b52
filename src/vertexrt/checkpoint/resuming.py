"""The one line every integration logs when it resumes: ``resuming from <dir> (step N)``.

The Trainer, ``CheckpointManager.restore()`` (``@main``/``ctx.checkpoints`` and the Keras callbacks go
through it), the Lightning checkpoint IO and the Hugging Face callback all log it, so a restarted replica's
log says where it picked up, in the same words whatever the framework.

Example:
    >>> log_resuming("gs://bucket/run/checkpoints", 1200)   # INFO: resuming from gs://... (step 1200)
"""

from __future__ import annotations

import logging
from typing import TypeVar

from vertexrt import uris

logger = logging.getLogger(__name__)

T = TypeVar("T")


def log_resuming(directory: str, step: int, detail: str = "", *, result: T = None) -> T:  # type: ignore[assignment]
    """Log ``resuming from <directory> (step <step>)``, with ``detail`` after a colon when given.

    Returns ``result``, so that ``return log_resuming(d, step, result=path)`` logs and answers in one line.
    """
    logger.info("resuming from %s (step %d)%s", uris.redact(directory), step, f": {detail}" if detail else "")
    return result

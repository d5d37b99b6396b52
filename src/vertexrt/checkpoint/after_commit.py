"""Rank 0's work after each commit of a :class:`~vertexrt.checkpoint.CheckpointManager`.

An overwrite's replaced version loses the files the new manifest no longer names (at once: the step stays
committed throughout), then the keep policy runs on one background thread (:mod:`.retention`), so a save
never waits for deletions; :meth:`AfterCommit.join` waits for the newest pass and raises its error.

Example:
    >>> after = AfterCommit(strategy, Retention(strategy, KeepLast(3), read_manifest))
    >>> site = Site(directory, strategy, rank, world_size, committed=after)
"""

from __future__ import annotations

import logging
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from vertexrt.checkpoint import manifest as manifest_format
from vertexrt.checkpoint.policies import CheckpointInfo
from vertexrt.checkpoint.retention import Retention
from vertexrt.checkpoint.storage import MANIFEST, Strategy
from vertexrt.errors import CheckpointError

log = logging.getLogger(__name__)


class AfterCommit:
    """The ``committed`` callback of a :class:`~vertexrt.checkpoint.step_writer.Site` on rank 0."""

    def __init__(self, strategy: Strategy, retention: Retention) -> None:
        self.strategy = strategy
        self.retention = retention
        self._deleter: ThreadPoolExecutor | None = None  # one retention thread, made on first use
        self._deleting: Future[None] | None = None  # the newest retention pass

    def __call__(self, step: int, token: str, manifest: dict[str, Any], replaced: bytes | None) -> None:
        """Retire a replaced version's files, then apply retention in the background."""
        if replaced is not None:
            self._retire(step, replaced, manifest)
        self.retention.infos[step] = CheckpointInfo(step, manifest["time"], manifest["metrics"])
        if self._deleter is None:
            self._deleter = ThreadPoolExecutor(1, thread_name_prefix="vertexrt-checkpoint-retention")
        self._deleting = self._deleter.submit(self.retention.apply, step, token)

    def join(self) -> None:
        """Wait for the newest retention pass; raise its error."""
        deleting, self._deleting = self._deleting, None
        if deleting is not None:
            deleting.result()

    def close(self) -> None:
        """Stop the retention thread (after the pass in flight)."""
        if self._deleter is not None:
            self._deleter.shutdown(wait=True)

    def _retire(self, step: int, replaced: bytes, manifest: dict[str, Any]) -> None:
        """Delete the files of the version an overwrite replaced (the new manifest names none of them)."""
        name = self.strategy.store.join(self.strategy.step_dir(step), MANIFEST)
        try:
            old = manifest_format.referenced(manifest_format.parse(replaced, name=name))
        except CheckpointError as exc:
            log.warning("the replaced manifest of step %d was unreadable (%s): its files stay", step, exc)
            return
        self.strategy.remove_files(step, sorted(old - manifest_format.referenced(manifest)))

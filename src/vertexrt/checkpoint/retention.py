"""Which committed steps survive (the keep policy), and removing dead writers' files from committed steps.

Runs after a commit, off the caller's thread; it never fails a save that is already committed, always keeps
the newest step and the step just saved, and deletes through the commit strategy (which un-commits first and
never follows a symlink).

Example:
    >>> Retention(strategy, KeepLast(3), read_manifest).apply(saved=1200, token=new_token())
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from vertexrt.checkpoint import manifest as manifest_format
from vertexrt.checkpoint.policies import CheckpointInfo, KeepPolicy
from vertexrt.checkpoint.storage import MANIFEST, Strategy
from vertexrt.errors import CheckpointError

log = logging.getLogger(__name__)

#: Steps deleted at once (each delete is a few storage requests; a pass after a long outage may have many).
DELETE_THREADS = 8


class Retention:
    """Applies ``keep_policy`` to the steps of ``strategy``; ``read_manifest(step)``: a parsed manifest."""

    def __init__(
        self, strategy: Strategy, keep_policy: KeepPolicy, read_manifest: Callable[[int], dict[str, Any]]
    ) -> None:
        self.strategy = strategy
        self.keep_policy = keep_policy
        self.read_manifest = read_manifest
        self.infos: dict[int, CheckpointInfo] = {}

    def apply(self, saved: int, token: str) -> None:
        """Delete the steps the keep policy drops; logs instead of raising."""
        try:
            self._apply(saved, token)
        except Exception as exc:  # retention must never fail a save that is already committed
            log.warning("applying the keep policy in %s failed: %s", self.strategy.root, exc)

    def _apply(self, saved: int, token: str) -> None:
        steps = self.strategy.committed_steps()
        if steps and steps[-1] > saved:
            log.warning(
                "saved step %d in %s, but step %d is newer: restore() returns the newest step, so delete the "
                "newer steps if training was rolled back",
                saved,
                self.strategy.root,
                steps[-1],
            )
        if len(steps) <= 1:
            return
        infos = [self._info(step) for step in steps]
        keep = self.keep_policy.keep(infos)
        doomed = [  # the newest is always kept
            info.step
            for info, kept in zip(infos[:-1], keep[:-1], strict=True)
            if not kept and info.step != saved
        ]
        if len(doomed) <= 1:
            for step in doomed:
                self._delete(step, token)
            return
        with ThreadPoolExecutor(min(DELETE_THREADS, len(doomed)), "vertexrt-checkpoint-delete") as pool:
            list(pool.map(lambda step: self._delete(step, token), doomed))

    def _delete(self, step: int, token: str) -> None:
        try:
            self.strategy.delete(step, token)
            self.infos.pop(step, None)
            log.debug("deleted checkpoint step %d (keep policy)", step)
        except Exception as exc:
            log.warning("could not delete checkpoint step %d in %s: %s", step, self.strategy.root, exc)

    def _info(self, step: int) -> CheckpointInfo:
        info = self.infos.get(step)
        if info is None:
            try:
                body = self.read_manifest(step)
                metrics = {k: v for k, v in body["metrics"].items() if v is not None}
                info = CheckpointInfo(step, float(body["time"]), metrics)
            except CheckpointError:
                info = CheckpointInfo(step, 0.0, {})
            self.infos[step] = info
        return info

    def sweep(self) -> list[str]:
        """Remove dead writers' files that no manifest names from committed steps (interrupted overwrites)."""
        removed: list[str] = []
        for step in self.strategy.committed_steps():
            try:
                used = manifest_format.referenced(self.read_manifest(step)) | {MANIFEST}
            except CheckpointError:
                continue  # an unreadable manifest: leave the step to restore()'s fallback
            directory = self.strategy.step_dir(step)
            dead = [
                e.name
                for e in self.strategy.store.listdir(directory)
                if not e.is_dir and e.name not in used and self.strategy.dead(e.name, e.mtime)
            ]
            self.strategy.remove_files(step, dead)
            removed.extend(f"{directory}/{name}" for name in dead)
        return removed

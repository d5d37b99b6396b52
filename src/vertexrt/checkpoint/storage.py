"""Where checkpoint bytes go and how a step is committed, chosen by ``paths.storage_kind`` in one place.

- ``local`` (POSIX): every file is written into ``.tmp.step_N.<writer>`` and fsynced, the manifest last, then
  the directory is renamed to ``step_N`` in one step (the rename is the commit).
- ``gcs`` and ``fuse`` (no atomic directory rename): files are written in place in ``step_N`` under names
  unique to the writer, and ``manifest.json`` is written *last* as one object (the manifest is the commit).

Readers only see steps with a manifest. Deleting a step un-commits it first (rename away / manifest first).
Leftovers of dead writers (temp dirs, un-committed steps) are removed by :meth:`Strategy.cleanup`. A writer
is identified by ``<host>-<pid>-<nonce>`` in every name it creates; on another host, a leftover counts as dead
once it is ``stale_after`` seconds old (:mod:`vertexrt.checkpoint.tokens`). The bytes go through a store
(:mod:`vertexrt.checkpoint.stores`).
"""

from __future__ import annotations

import logging
import os
import re
import shutil
from collections.abc import Sequence
from typing import Any

from vertexrt import paths
from vertexrt.checkpoint import tokens
from vertexrt.checkpoint.stores import FsspecStore, OsStore, fsync_dir, remove_no_follow, write_new
from vertexrt.errors import CheckpointError, PathError, StepExistsError

log = logging.getLogger(__name__)

MANIFEST = "manifest.json"
_STEP = re.compile(r"^step_(\d+)$")
_GCS_PART_SIZE = 16 << 20
_LOCAL_MIN_PART_SIZE = 64 << 20


def step_name(step: int) -> str:
    return f"step_{step:010d}"


class Strategy:
    """How steps under ``root`` are listed, written, committed and deleted."""

    part_size: int | None  # None: split the state into ``io_threads`` files of at least 64 MiB
    io_threads: int
    mmap_reads = False

    def __init__(self, store: Any, root: str, stale_after: float = 600.0) -> None:
        self.store = store
        self.root = root
        self.stale_after = stale_after

    def part_size_for(self, total: int) -> int:
        """Bytes per data file for a state of ``total`` bytes."""
        if self.part_size:
            return self.part_size
        per_thread = -(-total // max(self.io_threads, 1))
        return max(_LOCAL_MIN_PART_SIZE, -(-per_thread // (1 << 20)) * (1 << 20))

    def step_dir(self, step: int) -> str:
        return self.store.join(self.root, step_name(step))

    def committed_steps(self) -> list[int]:
        """Steps with a manifest, oldest first; a ``step_N`` that is not a real directory (a link) is not."""
        steps = []
        for entry in self.store.listdir(self.root):
            match = _STEP.match(entry.name)
            if match and entry.is_dir and self.is_committed(int(match[1])):
                steps.append(int(match[1]))
        return sorted(steps)

    def is_committed(self, step: int) -> bool:
        return bool(self.store.exists(self.store.join(self.step_dir(step), MANIFEST)))

    def remove_files(self, step: int, names: Sequence[str]) -> None:
        """Delete plain files ``names`` of step ``step`` (files a replaced manifest named, dead leftovers)."""
        directory = self.step_dir(step)
        for name in names:
            if "/" in name or name in ("", ".", ".."):
                continue
            try:
                self.store.remove_tree(self.store.join(directory, name))
            except FileNotFoundError:
                pass

    def read_manifest(self, step: int) -> bytes:
        return bytes(self.store.read_bytes(self.store.join(self.step_dir(step), MANIFEST)))

    def begin(self, step: int, token: str) -> str:
        raise NotImplementedError

    def commit(
        self, step: int, write_dir: str, manifest: bytes, token: str, overwrite: bool = False
    ) -> bytes | None:
        """Make ``step`` visible with ``manifest``; returns the manifest it replaced (``overwrite``) or None.

        Raises:
            StepExistsError: ``step`` is committed already and ``overwrite`` is False.
        """
        raise NotImplementedError

    def abort(self, write_dir: str, token: str) -> None:
        raise NotImplementedError

    def delete(self, step: int, token: str) -> None:
        raise NotImplementedError

    def cleanup(self) -> list[str]:
        raise NotImplementedError

    def dead(self, name: str, mtime: float) -> bool:
        """True when the writer named in ``name`` (its token) is gone; False for names without one."""
        return tokens.writer_gone(name, mtime, self.stale_after)


class RenameStrategy(Strategy):
    """Local POSIX: temp directory + one rename."""

    part_size = None
    io_threads = 2
    mmap_reads = True  # committed files are never modified in place, so mapped leaves stay valid

    def begin(self, step: int, token: str) -> str:
        path = os.path.join(self.root, f".tmp.{step_name(step)}.{token}")
        os.makedirs(path, exist_ok=True)
        return path

    def commit(
        self, step: int, write_dir: str, manifest: bytes, token: str, overwrite: bool = False
    ) -> bytes | None:
        """The rename of the temp directory is the commit; it never replaces a committed step.

        ``overwrite`` of a committed step moves the new (uniquely named) files into it, then replaces its
        manifest with one ``os.replace``: at every moment the step has one complete committed version.
        """
        self.store.write_file(os.path.join(write_dir, MANIFEST), [manifest])
        fsync_dir(write_dir)
        final = self.step_dir(step)
        try:
            os.rename(write_dir, final)  # fails when ``final`` is a non-empty directory: never replaces one
        except OSError as exc:
            if not os.path.lexists(final):
                raise
            if not overwrite:
                raise StepExistsError(
                    f"step {step} is already committed in {self.root} ({final}); pass overwrite=True to "
                    "save(...) to replace it, or save a new step number"
                ) from None
            if os.path.islink(final) or not os.path.isdir(final):
                raise CheckpointError(
                    f"cannot overwrite step {step}: {final} is not a checkpoint directory; remove it"
                ) from exc
            return self._replace_in_place(write_dir, final)
        fsync_dir(self.root)
        return None

    def _replace_in_place(self, write_dir: str, final: str) -> bytes | None:
        target = os.path.join(final, MANIFEST)
        try:
            for entry in os.scandir(write_dir):
                if entry.name != MANIFEST:  # token-unique names: nothing of the committed version is touched
                    os.rename(entry.path, os.path.join(final, entry.name))
        except FileNotFoundError:
            if os.path.lexists(final):
                raise
            shutil.rmtree(write_dir, ignore_errors=True)
            raise CheckpointError(
                f"{final} was deleted by another writer (its retention) while this save replaced it; "
                "earlier checkpoints are untouched: give each job its own checkpoint directory"
            ) from None
        fsync_dir(final)
        try:
            old: bytes | None = self.store.read_bytes(target)
        except FileNotFoundError:
            old = None
        os.replace(os.path.join(write_dir, MANIFEST), target)
        fsync_dir(final)
        shutil.rmtree(write_dir, ignore_errors=True)
        return old

    def abort(self, write_dir: str, token: str) -> None:
        shutil.rmtree(write_dir, ignore_errors=True)

    def delete(self, step: int, token: str) -> None:
        """Un-commit (rename away), then remove; a symlink is unlinked, never followed."""
        trash = os.path.join(self.root, f".trash.{step_name(step)}.{token}")
        try:
            os.rename(self.step_dir(step), trash)
        except FileNotFoundError:
            return
        remove_no_follow(trash)

    def cleanup(self) -> list[str]:
        removed = []
        for entry in self.store.listdir(self.root):
            if entry.name.startswith((".tmp.", ".trash.")) and self.dead(entry.name, entry.mtime):
                remove_no_follow(os.path.join(self.root, entry.name))
                removed.append(entry.name)
        return removed


class MarkerStrategy(Strategy):
    """``gs://`` and ``/gcs/``: write in place, manifest last."""

    part_size = _GCS_PART_SIZE
    io_threads = 16

    def begin(self, step: int, token: str) -> str:
        return self.step_dir(step)

    def commit(
        self, step: int, write_dir: str, manifest: bytes, token: str, overwrite: bool = False
    ) -> bytes | None:
        """The manifest, written last, is the commit: create-only, or replacing the old (``overwrite``)."""
        target = self.store.join(write_dir, MANIFEST)
        if not overwrite:
            try:
                write_new(self.store, target, manifest)
            except FileExistsError:
                raise StepExistsError(
                    f"step {step} is already committed in {self.root} ({target}); pass overwrite=True to "
                    "save(...) to replace it, or save a new step number"
                ) from None
            return None
        try:
            old: bytes | None = bytes(self.store.read_bytes(target))
        except FileNotFoundError:
            old = None
        self.store.write_atomic(target, manifest)
        return old

    def abort(self, write_dir: str, token: str) -> None:
        for entry in self.store.listdir(write_dir):
            if token in entry.name:
                self.store.remove_tree(self.store.join(write_dir, entry.name))

    def delete(self, step: int, token: str) -> None:
        directory = self.step_dir(step)
        if isinstance(self.store, OsStore) and os.path.islink(directory):
            os.unlink(directory)  # never delete another run's files through a link
            return
        self.store.remove_tree(self.store.join(directory, MANIFEST))
        self.store.remove_tree(directory)

    def cleanup(self) -> list[str]:
        removed = []
        for entry in self.store.listdir(self.root):
            if not _STEP.match(entry.name) or not entry.is_dir:
                continue
            directory = self.store.join(self.root, entry.name)
            files = self.store.listdir(directory)
            if any(f.name == MANIFEST for f in files):
                continue
            if files and all(self.dead(f.name, f.mtime) for f in files):
                self.store.remove_tree(directory)
                removed.append(entry.name)
        return removed


def strategy_for(directory: str, stale_after: float = 600.0) -> Strategy:
    """The commit strategy for ``directory`` (local path, ``/gcs/`` path or ``gs://`` URI)."""
    kind = paths.storage_kind(directory)
    fs, path = paths.filesystem(directory)
    local_fs = paths.is_local_filesystem(fs)
    if kind == "local":
        if not local_fs:
            raise PathError(
                f"checkpoint directory {directory!r}: only local paths, /gcs/ paths and gs:// URIs are "
                "supported (their commit protocol is known)"
            )
        os.makedirs(path, exist_ok=True)
        return RenameStrategy(OsStore(), path, stale_after)
    if local_fs:  # a mounted /gcs/ bucket: POSIX calls, but no atomic directory rename
        os.makedirs(path, exist_ok=True)
        return MarkerStrategy(OsStore(), path, stale_after)
    return MarkerStrategy(FsspecStore(fs), path, stale_after)

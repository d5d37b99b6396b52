"""Where checkpoint bytes go and how a step is committed, chosen by ``paths.storage_kind`` in one place.

- ``local`` (POSIX): every file is written into ``.tmp.step_N.<writer>`` and fsynced, the manifest last, then
  the directory is renamed to ``step_N`` in one step (the rename is the commit).
- ``gcs`` and ``fuse`` (no atomic directory rename): files are written in place in ``step_N`` under names
  unique to the writer, and ``manifest.json`` is written *last* as one object (the manifest is the commit).

Readers only see steps with a manifest. Deleting a step un-commits it first (rename away / manifest first).
Leftovers of dead writers (temp dirs, un-committed steps) are removed by :meth:`Strategy.cleanup`. A writer
is identified by ``<host>-<pid>-<nonce>`` in every name it creates; on another host, a leftover counts as dead
once it is ``stale_after`` seconds old.
"""

from __future__ import annotations

import errno
import logging
import os
import re
import shutil
import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Protocol

from vertexrt import paths, retries
from vertexrt.errors import CheckpointError, PathError, StepExistsError
from vertexrt.retries import Kind

log = logging.getLogger(__name__)

MANIFEST = "manifest.json"
_STEP = re.compile(r"^step_(\d+)$")
_TOKEN = re.compile(r"([A-Za-z0-9_]+)-(\d+)-([0-9a-f]{8})")
_GCS_PART_SIZE = 16 << 20
_LOCAL_MIN_PART_SIZE = 64 << 20


def step_name(step: int) -> str:
    return f"step_{step:010d}"


#: This process's nonce, the first 8 hex digits after the PID in every token it makes: a leftover with this
#: host and PID but another nonce was written by an earlier process that had the same PID (a restarted
#: container often does). One value per process, so nothing grows with the number of saves.
_PROCESS_NONCE = os.urandom(4).hex()


def new_token() -> str:
    """``<host>-<pid>-<process nonce><save nonce>``: names all one save writes, traceable to its writer."""
    return f"{_host()}-{os.getpid()}-{_PROCESS_NONCE}{os.urandom(4).hex()}"


def _reseed_after_fork() -> None:
    global _PROCESS_NONCE
    _PROCESS_NONCE = os.urandom(4).hex()


os.register_at_fork(after_in_child=_reseed_after_fork)


def _host() -> str:
    import socket

    return re.sub(r"[^A-Za-z0-9_]", "_", socket.gethostname()) or "host"


@dataclass(frozen=True)
class Entry:
    name: str
    is_dir: bool
    size: int
    mtime: float


class Store(Protocol):
    """The few file operations a checkpoint needs, over the OS or an fsspec filesystem."""

    def join(self, base: str, name: str) -> str: ...
    def write_file(self, path: str, views: Sequence[Any]) -> None: ...
    def write_atomic(self, path: str, data: bytes) -> None: ...
    def read_bytes(self, path: str) -> bytes: ...
    def read_ranges(self, path: str, ranges: Sequence[tuple[int, Any]], expected_size: int) -> None: ...
    def map(self, path: str, expected_size: int) -> Any: ...
    def listdir(self, path: str) -> list[Entry]: ...
    def exists(self, path: str) -> bool: ...
    def remove_tree(self, path: str) -> None: ...


class OsStore:
    """A POSIX directory (local disk or a mounted ``/gcs/`` bucket): plain syscalls, fsync on write."""

    def join(self, base: str, name: str) -> str:
        return os.path.join(base, name)

    def write_file(self, path: str, views: Sequence[Any]) -> None:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb", buffering=4 << 20) as f:
            for view in views:
                f.write(view)
            f.flush()
            os.fsync(f.fileno())

    def write_atomic(self, path: str, data: bytes) -> None:
        tmp = f"{path}.{new_token()}.tmp"
        self.write_file(tmp, [data])
        os.replace(tmp, path)
        fsync_dir(os.path.dirname(path))

    def read_bytes(self, path: str) -> bytes:
        with open_regular(path, buffering=-1) as f:
            return f.read()

    def read_ranges(self, path: str, ranges: Sequence[tuple[int, Any]], expected_size: int) -> None:
        with open_regular(path) as f:
            size = os.fstat(f.fileno()).st_size
            if size != expected_size:
                raise EOFError(f"{size} bytes on disk, the manifest says {expected_size}")
            for offset, view in ranges:
                f.seek(offset)
                mv = memoryview(view).cast("B")
                got = 0
                while got < len(mv):
                    n = f.readinto(mv[got:])
                    if not n:
                        raise EOFError(f"end of file at byte {offset + got}")
                    got += n

    def map(self, path: str, expected_size: int) -> Any:
        """The file as a 1-D uint8 array over a private (copy-on-write) memory map."""
        import mmap

        import numpy as np

        with open_regular(path) as f:
            size = os.fstat(f.fileno()).st_size
            if size != expected_size:
                raise EOFError(f"{size} bytes on disk, the manifest says {expected_size}")
            if size == 0:
                return np.empty(0, dtype=np.uint8)
            return np.frombuffer(mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY), dtype=np.uint8)

    def listdir(self, path: str) -> list[Entry]:
        try:
            entries = list(os.scandir(path))
        except FileNotFoundError:
            return []
        out = []
        for e in entries:
            try:
                st = e.stat(follow_symlinks=False)
            except FileNotFoundError:
                continue
            out.append(Entry(e.name, e.is_dir(follow_symlinks=False), st.st_size, st.st_mtime))
        return out

    def exists(self, path: str) -> bool:
        return os.path.exists(path)

    def remove_tree(self, path: str) -> None:
        if os.path.isfile(path) or os.path.islink(path):
            os.remove(path)
            return
        shutil.rmtree(path, ignore_errors=True)
        if os.path.exists(path):
            shutil.rmtree(path)


class FsspecStore:
    """An object store through fsspec (gcsfs for ``gs://``); listings always bypass the cache.

    Every call runs under a deadline with retries (:mod:`vertexrt.retries`): storage that stops
    answering fails the call in time with a :class:`~vertexrt.errors.StorageError` (a
    ``CheckpointError``) naming the operation and the ``gs://`` URI.
    """

    def __init__(self, fs: Any) -> None:
        self.fs = fs

    def join(self, base: str, name: str) -> str:
        return f"{base.rstrip('/')}/{name}"

    def write_file(self, path: str, views: Sequence[Any]) -> None:
        data = memoryview(views[0]) if len(views) == 1 else b"".join(views)
        self._call("writing", "pipe_file", path, data)

    def write_atomic(self, path: str, data: bytes) -> None:
        self._call("writing", "pipe_file", path, data)  # an object appears whole or not at all

    def write_new(self, path: str, data: bytes) -> None:
        """Create ``path`` only if it does not exist (an ``ifGenerationMatch=0`` precondition).

        Raises:
            FileExistsError: another object is there already (a retry that finds its own bytes succeeds).
        """
        try:
            self._call("creating", "pipe_file", path, data, mode="create")
        except FileExistsError:
            self.fs.invalidate_cache(path)
            if self._call("reading", "cat_file", path) != bytes(data):
                raise
        self.fs.invalidate_cache(path)

    def read_bytes(self, path: str) -> bytes:
        return bytes(self._call("reading", "cat_file", path))

    def read_ranges(self, path: str, ranges: Sequence[tuple[int, Any]], expected_size: int) -> None:
        import numpy as np

        data = self._call("reading", "cat_file", path)
        if len(data) != expected_size:
            raise EOFError(f"{len(data)} bytes stored, the manifest says {expected_size}")
        source = np.frombuffer(data, dtype=np.uint8)
        for offset, view in ranges:
            view[:] = source[offset : offset + len(view)]

    def map(self, path: str, expected_size: int) -> Any:
        raise NotImplementedError("object stores are read, not memory-mapped")

    def listdir(self, path: str) -> list[Entry]:
        try:
            items = self._call("listing", "ls", path, detail=True, refresh=True, kind="list")
        except FileNotFoundError:
            return []
        out = []
        for item in items:
            name = item["name"].rstrip("/").rsplit("/", 1)[-1]
            out.append(Entry(name, item.get("type") == "directory", int(item.get("size") or 0), _mtime(item)))
        return out

    def exists(self, path: str) -> bool:
        self.fs.invalidate_cache(path)
        return bool(self._call("checking", "exists", path, kind="list"))

    def remove_tree(self, path: str) -> None:
        try:
            self._call("deleting", "rm", path, recursive=True, kind="list")
        except FileNotFoundError:
            pass
        self.fs.invalidate_cache(path)

    def _call(
        self, operation: str, method: str, path: str, *args: Any, kind: Kind = "data", **kwargs: Any
    ) -> Any:
        uri = self.fs.unstrip_protocol(path)
        return retries.call(operation, uri, getattr(self.fs, method), path, *args, kind=kind, **kwargs)


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
        match = _TOKEN.search(name)
        if not match:
            return False
        host, pid = match[1], int(match[2])
        if host != _host():
            return time.time() - mtime > self.stale_after
        if pid == os.getpid():
            return match[3] != _PROCESS_NONCE
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        except PermissionError:
            return False
        return False


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
        _remove_no_follow(trash)

    def cleanup(self) -> list[str]:
        removed = []
        for entry in self.store.listdir(self.root):
            if entry.name.startswith((".tmp.", ".trash.")) and self.dead(entry.name, entry.mtime):
                _remove_no_follow(os.path.join(self.root, entry.name))
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


def write_new(store: Any, path: str, data: bytes) -> None:
    """Write ``path`` whole, only if it does not exist: create-only where the store can do it atomically.

    Raises:
        FileExistsError: ``path`` exists already (nothing was changed).
    """
    if not isinstance(store, OsStore):  # gs:// through gcsfs: an ifGenerationMatch=0 precondition
        store.write_new(path, data)
        return
    tmp = f"{path}.{new_token()}.tmp"
    store.write_file(tmp, [data])
    try:
        os.link(tmp, path)  # atomic create-only
    except FileExistsError:
        raise
    except OSError as exc:  # a mount without hard links (gcsfuse): check, then rename
        if exc.errno not in (errno.EPERM, errno.ENOTSUP, errno.ENOSYS, errno.EOPNOTSUPP, errno.EXDEV):
            raise
        if os.path.lexists(path):
            raise FileExistsError(path) from None
        os.replace(tmp, path)
    finally:
        if os.path.lexists(tmp):
            os.remove(tmp)
    fsync_dir(os.path.dirname(path))


def open_regular(path: str, buffering: int = 0) -> Any:
    """``open(path, "rb")`` that refuses a symlink, FIFO, device or directory (never blocks on one).

    Raises:
        CheckpointCorruptError: ``path`` is not a regular file.
        FileNotFoundError: ``path`` does not exist.
    """
    import stat

    from vertexrt.errors import CheckpointCorruptError

    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(path, flags)
    except OSError as exc:
        if exc.errno != errno.ELOOP:
            raise
        raise CheckpointCorruptError(f"{path} is a symlink; checkpoint files must be plain files", file=path)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise CheckpointCorruptError(
            f"{path} is not a regular file (a FIFO, device or directory); checkpoints hold plain files",
            file=path,
        )
    os.set_blocking(fd, True)
    return os.fdopen(fd, "rb", buffering=buffering)


def _remove_no_follow(path: str) -> None:
    """Remove a directory tree, or just the link/file when ``path`` is one (links are never followed)."""
    if os.path.islink(path) or not os.path.isdir(path):
        try:
            os.remove(path)
        except FileNotFoundError:
            pass
        return
    shutil.rmtree(path, ignore_errors=True)


def fsync_dir(path: str) -> None:
    """Make a rename/create in ``path`` durable (a no-op where directories cannot be fsynced, e.g. FUSE)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError as exc:
        if exc.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EBADF, errno.ENOSYS, errno.EPERM):
            raise
    finally:
        os.close(fd)


def _mtime(item: dict[str, Any]) -> float:
    for key in ("mtime", "updated", "timeCreated"):
        value = item.get(key)
        if isinstance(value, (int, float)):
            return float(value)
        if isinstance(value, datetime):
            return value.timestamp()
        if isinstance(value, str):
            try:
                return datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()
            except ValueError:
                continue
    return time.time()

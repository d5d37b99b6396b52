"""Checkpoint bytes in and out, with no commit rules: a :class:`Store` over the OS or an fsspec filesystem.

:class:`OsStore` writes POSIX files (local disk or a mounted ``/gcs/`` bucket) with fsync;
:class:`FsspecStore` writes objects (``gs://`` through gcsfs) under the storage deadline and retries.
:func:`write_new` creates a file only if it is absent, :func:`open_regular` opens nothing but a plain
file. When a step is committed is decided by :mod:`vertexrt.checkpoint.storage`, not here::

    store = OsStore()
    write_new(store, store.join(directory, "manifest.json"), data)  # FileExistsError if it is there
    assert store.read_bytes(store.join(directory, "manifest.json")) == data
"""

from __future__ import annotations

import errno
import os
import shutil
import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Protocol

from vertexrt import retries
from vertexrt.checkpoint import tokens
from vertexrt.retries import Kind


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
        tmp = f"{path}.{tokens.new_token()}.tmp"
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


def write_new(store: Any, path: str, data: bytes) -> None:
    """Write ``path`` whole, only if it does not exist: create-only where the store can do it atomically.

    Raises:
        FileExistsError: ``path`` exists already (nothing was changed).
    """
    if not isinstance(store, OsStore):  # gs:// through gcsfs: an ifGenerationMatch=0 precondition
        store.write_new(path, data)
        return
    tmp = f"{path}.{tokens.new_token()}.tmp"
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


def remove_no_follow(path: str) -> None:
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

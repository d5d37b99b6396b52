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

from vertexrt import paths
from vertexrt.errors import CheckpointError, PathError

log = logging.getLogger(__name__)

MANIFEST = "manifest.json"
_STEP = re.compile(r"^step_(\d+)$")
_TOKEN = re.compile(r"([A-Za-z0-9_]+)-(\d+)-([0-9a-f]{8})")
_GCS_PART_SIZE = 16 << 20
_LOCAL_MIN_PART_SIZE = 64 << 20


def step_name(step: int) -> str:
    return f"step_{step:010d}"


#: Nonces of the tokens this process made: a leftover with this host and PID but another nonce was written
#: by an earlier process that had the same PID (a restarted container often does).
_OWN_NONCES: set[str] = set()


def new_token() -> str:
    """``<host>-<pid>-<nonce>``: names everything one save writes, so leftovers can be traced to a writer."""
    nonce = os.urandom(4).hex()
    _OWN_NONCES.add(nonce)
    return f"{_host()}-{os.getpid()}-{nonce}"


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
        with open(path, "rb") as f:
            return f.read()

    def read_ranges(self, path: str, ranges: Sequence[tuple[int, Any]], expected_size: int) -> None:
        with open(path, "rb", buffering=0) as f:
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

        with open(path, "rb") as f:
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

    def rename(self, src: str, dst: str) -> None:
        os.rename(src, dst)


class FsspecStore:
    """An object store through fsspec (gcsfs for ``gs://``); listings always bypass the cache."""

    def __init__(self, fs: Any) -> None:
        self.fs = fs

    def join(self, base: str, name: str) -> str:
        return f"{base.rstrip('/')}/{name}"

    def write_file(self, path: str, views: Sequence[Any]) -> None:
        self.fs.pipe_file(path, memoryview(views[0]) if len(views) == 1 else b"".join(views))

    def write_atomic(self, path: str, data: bytes) -> None:
        self.fs.pipe_file(path, data)  # an object appears whole or not at all

    def read_bytes(self, path: str) -> bytes:
        return bytes(self.fs.cat_file(path))

    def read_ranges(self, path: str, ranges: Sequence[tuple[int, Any]], expected_size: int) -> None:
        import numpy as np

        data = self.fs.cat_file(path)
        if len(data) != expected_size:
            raise EOFError(f"{len(data)} bytes stored, the manifest says {expected_size}")
        source = np.frombuffer(data, dtype=np.uint8)
        for offset, view in ranges:
            view[:] = source[offset : offset + len(view)]

    def map(self, path: str, expected_size: int) -> Any:
        raise NotImplementedError("object stores are read, not memory-mapped")

    def listdir(self, path: str) -> list[Entry]:
        try:
            items = self.fs.ls(path, detail=True, refresh=True)
        except FileNotFoundError:
            return []
        out = []
        for item in items:
            name = item["name"].rstrip("/").rsplit("/", 1)[-1]
            out.append(Entry(name, item.get("type") == "directory", int(item.get("size") or 0), _mtime(item)))
        return out

    def exists(self, path: str) -> bool:
        self.fs.invalidate_cache(path)
        return bool(self.fs.exists(path))

    def remove_tree(self, path: str) -> None:
        try:
            self.fs.rm(path, recursive=True)
        except FileNotFoundError:
            pass
        self.fs.invalidate_cache(path)


class Strategy:
    """How steps under ``root`` are listed, written, committed and deleted."""

    kind: str
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
        steps = []
        for entry in self.store.listdir(self.root):
            match = _STEP.match(entry.name)
            if match and self.store.exists(self.store.join(self.step_dir(int(match[1])), MANIFEST)):
                steps.append(int(match[1]))
        return sorted(steps)

    def read_manifest(self, step: int) -> bytes:
        return bytes(self.store.read_bytes(self.store.join(self.step_dir(step), MANIFEST)))

    def begin(self, step: int, token: str) -> str:
        raise NotImplementedError

    def commit(self, step: int, write_dir: str, manifest: bytes, token: str) -> None:
        raise NotImplementedError

    def abort(self, write_dir: str, token: str) -> None:
        raise NotImplementedError

    def delete(self, step: int, token: str) -> None:
        raise NotImplementedError

    def cleanup(self) -> list[str]:
        raise NotImplementedError

    def _dead(self, name: str, mtime: float) -> bool:
        match = _TOKEN.search(name)
        if not match:
            return False
        host, pid = match[1], int(match[2])
        if host != _host():
            return time.time() - mtime > self.stale_after
        if pid == os.getpid():
            return match[3] not in _OWN_NONCES
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        except PermissionError:
            return False
        return False


class RenameStrategy(Strategy):
    """Local POSIX: temp directory + one rename."""

    kind = "local"
    part_size = None
    io_threads = 2
    mmap_reads = True  # committed files are never modified in place, so mapped leaves stay valid

    def begin(self, step: int, token: str) -> str:
        path = os.path.join(self.root, f".tmp.{step_name(step)}.{token}")
        os.makedirs(path, exist_ok=True)
        return path

    def commit(self, step: int, write_dir: str, manifest: bytes, token: str) -> None:
        self.store.write_file(os.path.join(write_dir, MANIFEST), [manifest])
        fsync_dir(write_dir)
        final = self.step_dir(step)
        for _ in range(5):
            try:
                os.rename(write_dir, final)
                break
            except OSError:
                if not os.path.exists(final):
                    raise
                log.warning("step %d already exists in %s: replacing it", step, self.root)
                trash = os.path.join(self.root, f".trash.{step_name(step)}.{new_token()}")
                try:
                    os.rename(final, trash)
                except FileNotFoundError:
                    continue
                shutil.rmtree(trash, ignore_errors=True)
        else:
            raise CheckpointError(
                f"could not commit step {step} in {self.root}: another writer kept replacing "
                f"{step_name(step)}; the step stays uncommitted"
            )
        fsync_dir(self.root)

    def abort(self, write_dir: str, token: str) -> None:
        shutil.rmtree(write_dir, ignore_errors=True)

    def delete(self, step: int, token: str) -> None:
        trash = os.path.join(self.root, f".trash.{step_name(step)}.{token}")
        try:
            os.rename(self.step_dir(step), trash)
        except FileNotFoundError:
            return
        shutil.rmtree(trash, ignore_errors=True)

    def cleanup(self) -> list[str]:
        removed = []
        for entry in self.store.listdir(self.root):
            if entry.name.startswith((".tmp.", ".trash.")) and self._dead(entry.name, entry.mtime):
                shutil.rmtree(os.path.join(self.root, entry.name), ignore_errors=True)
                removed.append(entry.name)
        return removed


class MarkerStrategy(Strategy):
    """``gs://`` and ``/gcs/``: write in place, manifest last."""

    kind = "gcs"
    part_size = _GCS_PART_SIZE
    io_threads = 16

    def begin(self, step: int, token: str) -> str:
        return self.step_dir(step)

    def commit(self, step: int, write_dir: str, manifest: bytes, token: str) -> None:
        self.store.write_atomic(self.store.join(write_dir, MANIFEST), manifest)

    def abort(self, write_dir: str, token: str) -> None:
        for entry in self.store.listdir(write_dir):
            if token in entry.name:
                self.store.remove_tree(self.store.join(write_dir, entry.name))

    def delete(self, step: int, token: str) -> None:
        directory = self.step_dir(step)
        self.store.remove_tree(self.store.join(directory, MANIFEST))
        self.store.remove_tree(directory)

    def cleanup(self) -> list[str]:
        removed = []
        for entry in self.store.listdir(self.root):
            if not _STEP.match(entry.name):
                continue
            directory = self.store.join(self.root, entry.name)
            files = self.store.listdir(directory)
            if any(f.name == MANIFEST for f in files):
                continue
            if files and all(self._dead(f.name, f.mtime) for f in files):
                self.store.remove_tree(directory)
                removed.append(entry.name)
        return removed


def strategy_for(directory: str, stale_after: float = 600.0) -> Strategy:
    """The commit strategy for ``directory`` (local path, ``/gcs/`` path or ``gs://`` URI)."""
    kind = paths.storage_kind(directory)
    fs, path = paths.filesystem(directory)
    local_fs = "file" in (fs.protocol if isinstance(fs.protocol, tuple) else (fs.protocol,))
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
        strategy = MarkerStrategy(OsStore(), path, stale_after)
        strategy.kind = "fuse"
        return strategy
    return MarkerStrategy(FsspecStore(fs), path, stale_after)


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

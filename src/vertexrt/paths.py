"""One way to touch storage: local paths, the ``/gcs/`` Cloud Storage FUSE mount, and ``gs://`` URIs.

``gs://BUCKET/obj`` and ``/gcs/BUCKET/obj`` name the same object. A ``/gcs/`` path is served by the mount
when the bucket is mounted and by the Cloud Storage API (gcsfs) otherwise, so code written for Vertex runs
on a laptop too. ``VERTEXRT_FUSE_ROOT`` moves the mount point (a local mirror directory, or tests).
Nothing resolves outside its bucket: ``.``/``..``/empty segments (``gs://b//etc``), NUL bytes, a mistyped
scheme (``gs:/b``) and symlinks leading out of a mounted bucket are a :class:`~vertexrt.errors.PathError`.

Example:
    >>> from vertexrt import paths
    >>> paths.to_fuse("gs://my-bucket/runs/1/model.pt")
    '/gcs/my-bucket/runs/1/model.pt'
    >>> with paths.open("gs://my-bucket/runs/1/metrics.json", "w") as f:
    ...     f.write("{}")
"""

from __future__ import annotations

import os

from vertexrt import uris
from vertexrt.errors import PathError

TYPE_CHECKING = False  # `typing` and `re` stay off the import path (~10 ms)
if TYPE_CHECKING:
    from typing import IO, Any, Literal

    from fsspec import AbstractFileSystem

    StorageKind = Literal["local", "fuse", "gcs"]

GCS_SCHEME = uris.GCS_SCHEME
FUSE_PREFIX = uris.FUSE_PREFIX
is_gcs = uris.is_gcs
is_fuse = uris.is_fuse
split_gcs = uris.split_gcs
redact = uris.redact


def fuse_root() -> str:
    """Where ``/gcs/`` is physically mounted: ``$VERTEXRT_FUSE_ROOT`` or ``/gcs``."""
    return os.environ.get("VERTEXRT_FUSE_ROOT", "/gcs").rstrip("/") or "/gcs"


def to_fuse(uri: str) -> str:
    """``gs://b/o`` -> ``/gcs/b/o`` (the logical FUSE path; a FUSE path is returned unchanged)."""
    if is_fuse(uri):
        uris.split_fuse(uri)
        return str(uri)
    bucket, obj = split_gcs(uri)
    return f"{FUSE_PREFIX}{bucket}/{obj}" if obj else f"{FUSE_PREFIX}{bucket}"


def to_gcs(path: str) -> str:
    """``/gcs/b/o`` -> ``gs://b/o`` (a gs:// URI is validated and returned unchanged)."""
    if is_gcs(path):
        split_gcs(path)
        return str(path)
    bucket, obj = uris.split_fuse(path)
    return f"{GCS_SCHEME}{bucket}/{obj}" if obj else f"{GCS_SCHEME}{bucket}"


def join(base: str, *parts: str) -> str:
    """Join path segments under ``base`` keeping its form (local, ``/gcs/``, ``gs://``).

    Example:
        >>> paths.join("gs://my-bucket/base/", "3", "model")
        'gs://my-bucket/base/3/model'
    """
    text = str(base)
    if not text:
        raise PathError("paths.join: the base is an empty string; give a directory or URI to join under")
    pieces = [text.rstrip("/") if text.rstrip("/") else text]
    pieces += [str(p).strip("/") for p in parts if str(p).strip("/")]
    joined = "/".join(pieces) if pieces[0] != "/" else "/" + "/".join(pieces[1:])
    if is_gcs(joined):
        split_gcs(joined)
    elif is_fuse(joined):
        uris.split_fuse(joined)
    return joined


def storage_kind(uri: str) -> StorageKind:
    """Which commit strategy applies to ``uri``.

    ``"local"``: a POSIX filesystem where a directory rename is atomic. ``"fuse"``: a ``/gcs/`` path (no
    atomic directory rename). ``"gcs"``: a ``gs://`` object store.
    """
    uris.check_text(str(uri))
    if is_gcs(uri):
        split_gcs(uri)
        return "gcs"
    if is_fuse(uri):
        uris.split_fuse(uri)
        return "fuse"
    return "local"


def filesystem(uri: str, *, prefer_fuse: bool | None = None) -> tuple[AbstractFileSystem, str]:
    """An fsspec filesystem for ``uri`` and the path to use with it.

    Local paths get the local filesystem and an absolute path. ``gs://`` URIs get gcsfs and
    ``"bucket/obj"`` (rebuild a URI with ``fs.unstrip_protocol(path)``), or the FUSE mount when
    ``prefer_fuse`` (default: ``$VERTEXRT_PREFER_FUSE``) and the bucket is mounted. ``/gcs/`` paths use the
    mount when the bucket is mounted, else gcsfs.

    Example:
        >>> fs, path = paths.filesystem("gs://my-bucket/data")
        >>> fs.ls(path)
    """
    text = str(uri)
    if not text:
        raise PathError("an empty string is not a path or URI")
    uris.check_text(text)
    if prefer_fuse is None:
        prefer_fuse = os.environ.get("VERTEXRT_PREFER_FUSE", "").lower() in ("1", "true", "yes")
    if is_gcs(text):
        bucket, obj = split_gcs(text)
        mounted = _mounted_path(bucket, obj) if prefer_fuse else None
        return (_local_fs(), mounted) if mounted else (gcs_filesystem(), f"{bucket}/{obj}".rstrip("/"))
    if is_fuse(text):
        bucket, obj = uris.split_fuse(text)
        mounted = _mounted_path(bucket, obj)
        return (_local_fs(), mounted) if mounted else (gcs_filesystem(), f"{bucket}/{obj}".rstrip("/"))
    if "://" in text and not text.startswith("file://"):
        import fsspec.core

        fs, path = fsspec.core.url_to_fs(text)
        return fs, path
    local = text[len("file://") :] if text.startswith("file://") else text
    return _local_fs(), os.path.abspath(os.path.expanduser(local))


def open(  # noqa: A001 - mirrors the builtin on purpose: paths.open(uri, mode)
    uri: str,
    mode: str = "rb",
    *,
    block_size: int | None = None,
    prefer_fuse: bool | None = None,
    **kwargs: Any,
) -> IO[Any]:
    """Open a local path, ``/gcs/`` path or ``gs://`` URI; parents are created for writes.

    Example:
        >>> with paths.open("gs://my-bucket/run/log.txt", "w") as f:
        ...     f.write("hello")
    """
    text = str(uri)
    if (is_gcs(text) or is_fuse(text)) and not _object_part(text):
        raise PathError(f"{text!r} names a bucket, not an object: add an object name after the bucket")
    fs, path = filesystem(text, prefer_fuse=prefer_fuse)
    if any(flag in mode for flag in "wax") and is_local_filesystem(fs):
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    if block_size is not None and not is_local_filesystem(fs):
        kwargs["block_size"] = block_size
    return fs.open(path, mode, **kwargs)  # type: ignore[no-any-return]


def gcs_filesystem() -> AbstractFileSystem:
    """The process's gcsfs filesystem, configured by :func:`vertexrt.clients.storage_options`.

    Against an emulator (``STORAGE_EMULATOR_HOST``) it uses gcsfs's core class: the "extended" class
    probes a gRPC control API first and stalls 60 s per operation on anything but real Cloud Storage.
    """
    from vertexrt.clients import emulator_endpoint, storage_options

    options = storage_options()
    if emulator_endpoint():
        os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")
        from gcsfs.core import GCSFileSystem

        return GCSFileSystem(**options)
    import fsspec

    return fsspec.filesystem("gs", **options)


def _local_fs() -> AbstractFileSystem:
    from fsspec.implementations.local import LocalFileSystem

    return LocalFileSystem()


def is_local_filesystem(fs: AbstractFileSystem) -> bool:
    """True for fsspec's local filesystem (local disk, or a mounted ``/gcs/`` bucket served as files)."""
    protocol = fs.protocol
    return "file" in (protocol if isinstance(protocol, tuple) else (protocol,))


def _mounted_path(bucket: str, obj: str) -> str | None:
    """The file serving ``obj`` on the mount, or None when the bucket is not mounted.

    ``obj`` is already validated (no ``..``, ``.`` or empty segment); the resolved path is checked again so
    that a symlink on a local mirror cannot lead outside the bucket's directory either.
    """
    bucket_dir = os.path.join(fuse_root(), bucket)
    if not os.path.isdir(bucket_dir):
        return None
    if not obj:
        return bucket_dir
    target = os.path.join(bucket_dir, obj)
    root, resolved = os.path.realpath(bucket_dir), os.path.realpath(target)
    if os.path.commonpath([root, resolved]) != root:
        raise PathError(
            f"/gcs/{bucket}/{obj} resolves to {resolved!r}, outside the mounted bucket {root!r}: remove the "
            "symlink or use a path inside the bucket"
        )
    return target


def _object_part(text: str) -> str:
    return uris.split(text)[1].strip("/")


def upload(local_dir: str, uri: str, *, workers: int = 8) -> list[str]:
    """Copy every file under ``local_dir`` to ``uri`` (``gs://``, ``/gcs/`` or local), ``workers`` at a time.

    Returns the destinations written, sorted. A symlink leading out of ``local_dir`` is refused (it would
    upload a file from elsewhere on the machine).

    Example:
        >>> paths.upload("outputs/model", "gs://my-bucket/run/1/model")
        ['gs://my-bucket/run/1/model/config.json', 'gs://my-bucket/run/1/model/weights.bin']
    """
    return copy_tree(local_dir, uri, workers=workers)


def download(uri: str, local_dir: str, *, workers: int = 8) -> list[str]:
    """Copy every object under ``uri`` into ``local_dir``, ``workers`` at a time; returns the files written.

    An object name that would land outside ``local_dir`` (a ``..`` or empty segment, or a symlink already in
    ``local_dir`` leading out of it) is refused before anything is written.

    Example:
        >>> paths.download("gs://my-bucket/run/1/model", "/tmp/model")
        ['/tmp/model/config.json', '/tmp/model/weights.bin']
    """
    return copy_tree(uri, local_dir, workers=workers)


def copy_tree(source: str, destination: str, *, workers: int = 8) -> list[str]:
    """Copy the files under ``source`` to ``destination`` (each local, ``/gcs/`` or ``gs://``).

    Raises:
        PathError: ``source`` does not exist, a name would escape either tree, or a copy failed (the message
            names the file).
    """
    if not 1 <= workers <= 256:
        raise PathError(f"workers={workers}: give a number of parallel copies from 1 to 256")
    names = _tree_files(str(source))
    pairs = [(join(source, name), _destination(str(destination), name)) for name in names]
    if not pairs:
        return []
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=min(workers, len(pairs)), thread_name_prefix="vertexrt-copy") as pool:
        return sorted(pool.map(_copy_file, pairs))


_COPY_BLOCK = 16 << 20  # >= 16 MiB blocks: gcsfs's default 5 MiB halves upload throughput


def _copy_file(pair: tuple[str, str]) -> str:
    import shutil

    src, dst = pair
    try:
        with open(src, "rb") as reader, open(dst, "wb", block_size=_COPY_BLOCK) as writer:
            shutil.copyfileobj(reader, writer, _COPY_BLOCK)
    except PathError:
        raise
    except Exception as err:
        raise PathError(
            f"copying {redact(src)} to {redact(dst)} failed: {type(err).__name__}: {err}; check that the "
            "destination is writable and the source readable, then copy again"
        ) from err
    return dst


def _tree_files(source: str) -> list[str]:
    """The relative names of the files under ``source``, validated, sorted."""
    fs, root = filesystem(source)
    if is_local_filesystem(fs):
        if not os.path.isdir(root):
            raise PathError(f"{source!r} is not a directory: give the directory whose files to copy")
        names = []
        real_root = os.path.realpath(root)
        for folder, dirs, files in os.walk(root):
            for entry in dirs + files:
                full = os.path.join(folder, entry)
                if (
                    os.path.islink(full)
                    and os.path.commonpath([real_root, os.path.realpath(full)]) != real_root
                ):
                    raise PathError(
                        f"{full!r} is a symlink to {os.path.realpath(full)!r}, outside {source!r}: remove it "
                        "or copy the file into the directory"
                    )
            names += [os.path.relpath(os.path.join(folder, f), root) for f in files]
    else:
        found = fs.find(root)
        if root in found:
            raise PathError(f"{redact(source)!r} is one object, not a prefix: copy it with paths.open")
        if not found and not fs.exists(root):
            raise PathError(f"{redact(source)!r} holds no objects: check the bucket and prefix")
        names = [key[len(root) :].lstrip("/") for key in found if not key.endswith("/")]
    for name in names:
        _check_relative(name, source)
    return sorted(names)


def _check_relative(name: str, source: str) -> None:
    segments = name.replace(os.sep, "/").split("/")
    if "\x00" in name or any(s in ("", ".", "..") for s in segments):
        raise PathError(
            f"{redact(source)!r} holds {name!r}, whose '.', '..' or empty segment would be written outside "
            "the destination: rename or remove that object"
        )


def _destination(base: str, name: str) -> str:
    target = join(base, name)
    if storage_kind(base) == "local":
        root = os.path.realpath(os.path.abspath(base))
        resolved = os.path.realpath(os.path.abspath(target))
        if os.path.commonpath([root, resolved]) != root:
            raise PathError(
                f"{target!r} resolves to {resolved!r}, outside the destination {root!r}: remove the symlink "
                "in the destination or choose another directory"
            )
    return target

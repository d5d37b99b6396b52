"""One way to touch storage: local paths, the ``/gcs/`` Cloud Storage FUSE mount, and ``gs://`` URIs.

``gs://BUCKET/obj`` and ``/gcs/BUCKET/obj`` name the same object. A ``/gcs/`` path is served by the mount
when the bucket is mounted and by the Cloud Storage API (gcsfs) otherwise, so code written for Vertex runs
on a laptop too. ``VERTEXRT_FUSE_ROOT`` moves the mount point (a local mirror directory, or tests).

Example:
    >>> from vertexrt import paths
    >>> paths.to_fuse("gs://my-bucket/runs/1/model.pt")
    '/gcs/my-bucket/runs/1/model.pt'
    >>> with paths.open("gs://my-bucket/runs/1/metrics.json", "w") as f:
    ...     f.write("{}")
"""

from __future__ import annotations

import os

from vertexrt.errors import PathError

TYPE_CHECKING = False  # `typing` and `re` stay off the import path (~10 ms)
if TYPE_CHECKING:
    from typing import IO, Any, Literal

    from fsspec import AbstractFileSystem

    StorageKind = Literal["local", "fuse", "gcs"]

GCS_SCHEME = "gs://"
FUSE_PREFIX = "/gcs/"

_BUCKET_EDGE = frozenset("abcdefghijklmnopqrstuvwxyz0123456789")
_BUCKET_CHARS = _BUCKET_EDGE | frozenset("._-")
_MAX_OBJECT_BYTES = 1024


def is_gcs(uri: str) -> bool:
    """True for a ``gs://`` URI."""
    return str(uri).startswith(GCS_SCHEME)


def is_fuse(path: str) -> bool:
    """True for a path on the Cloud Storage FUSE mount (``/gcs/BUCKET/...``)."""
    text = str(path)
    return text.startswith(FUSE_PREFIX) or text == FUSE_PREFIX.rstrip("/")


def fuse_root() -> str:
    """Where ``/gcs/`` is physically mounted: ``$VERTEXRT_FUSE_ROOT`` or ``/gcs``."""
    return os.environ.get("VERTEXRT_FUSE_ROOT", "/gcs").rstrip("/") or "/gcs"


def split_gcs(uri: str) -> tuple[str, str]:
    """``gs://bucket/a/b`` -> ``("bucket", "a/b")``; the object part may be empty.

    Raises:
        PathError: not a gs:// URI, a bucket name Cloud Storage would refuse, or a ``..`` segment.
    """
    text = str(uri)
    if not is_gcs(text):
        raise PathError(f"{text!r} is not a gs:// URI")
    bucket, _, obj = text[len(GCS_SCHEME) :].partition("/")
    _check_bucket(bucket, text)
    _check_object(obj, text)
    return bucket, obj


def to_fuse(uri: str) -> str:
    """``gs://b/o`` -> ``/gcs/b/o`` (the logical FUSE path; a FUSE path is returned unchanged)."""
    if is_fuse(uri):
        _split_fuse(uri)
        return str(uri)
    bucket, obj = split_gcs(uri)
    return f"{FUSE_PREFIX}{bucket}/{obj}" if obj else f"{FUSE_PREFIX}{bucket}"


def to_gcs(path: str) -> str:
    """``/gcs/b/o`` -> ``gs://b/o`` (a gs:// URI is validated and returned unchanged)."""
    if is_gcs(path):
        split_gcs(path)
        return str(path)
    bucket, obj = _split_fuse(path)
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
        _split_fuse(joined)
    return joined


def storage_kind(uri: str) -> StorageKind:
    """Which commit strategy applies to ``uri``.

    ``"local"``: a POSIX filesystem where a directory rename is atomic. ``"fuse"``: a ``/gcs/`` path (no
    atomic directory rename). ``"gcs"``: a ``gs://`` object store.
    """
    if is_gcs(uri):
        split_gcs(uri)
        return "gcs"
    if is_fuse(uri):
        _split_fuse(uri)
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
    if prefer_fuse is None:
        prefer_fuse = os.environ.get("VERTEXRT_PREFER_FUSE", "").lower() in ("1", "true", "yes")
    if is_gcs(text):
        bucket, obj = split_gcs(text)
        mounted = _mounted_path(bucket, obj) if prefer_fuse else None
        return (_local_fs(), mounted) if mounted else (gcs_filesystem(), f"{bucket}/{obj}".rstrip("/"))
    if is_fuse(text):
        bucket, obj = _split_fuse(text)
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
    if any(flag in mode for flag in "wax") and _is_local(fs):
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    if block_size is not None and not _is_local(fs):
        kwargs["block_size"] = block_size
    return fs.open(path, mode, **kwargs)  # type: ignore[no-any-return]


def gcs_filesystem() -> AbstractFileSystem:
    """The process's gcsfs filesystem, configured by :func:`vertexrt.env.storage_options`.

    Against an emulator (``STORAGE_EMULATOR_HOST``) it uses gcsfs's core class: the "extended" class
    probes a gRPC control API first and stalls 60 s per operation on anything but real Cloud Storage.
    """
    from vertexrt.env import emulator_endpoint, storage_options

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


def _is_local(fs: AbstractFileSystem) -> bool:
    protocol = fs.protocol
    return "file" in (protocol if isinstance(protocol, tuple) else (protocol,))


def _mounted_path(bucket: str, obj: str) -> str | None:
    bucket_dir = os.path.join(fuse_root(), bucket)
    if not os.path.isdir(bucket_dir):
        return None
    return os.path.join(bucket_dir, obj) if obj else bucket_dir


def _split_fuse(path: str) -> tuple[str, str]:
    text = str(path)
    if not is_fuse(text):
        raise PathError(f"{text!r} is not a /gcs/ path")
    bucket, _, obj = text[len(FUSE_PREFIX) :].partition("/")
    if not bucket:
        raise PathError(f"{text!r} has no bucket: expected /gcs/BUCKET/object")
    _check_bucket(bucket, text)
    _check_object(obj, text)
    return bucket, obj


def _object_part(text: str) -> str:
    return (split_gcs(text) if is_gcs(text) else _split_fuse(text))[1].strip("/")


def _check_bucket(bucket: str, uri: str) -> None:
    """Cloud Storage's bucket naming rules."""
    if not bucket:
        raise PathError(f"{uri!r} has no bucket name: expected gs://BUCKET/object")
    problem = None
    if bucket != bucket.lower():
        problem = "bucket names must be lowercase"
    elif (
        len(bucket) < 3
        or not set(bucket) <= _BUCKET_CHARS
        or bucket[0] not in _BUCKET_EDGE
        or bucket[-1] not in _BUCKET_EDGE
    ):
        problem = (
            "bucket names are 3-63 characters of a-z, 0-9, '-', '_' and '.', starting and ending with a "
            "letter or digit"
        )
    elif ".." in bucket or ".-" in bucket or "-." in bucket:
        problem = "bucket names cannot contain '..', '.-' or '-.'"
    elif len(bucket) > 222 or any(len(part) > 63 for part in bucket.split(".")):
        problem = "bucket names are at most 63 characters (222 with dots, 63 per dot-separated part)"
    elif len(bucket.split(".")) == 4 and all(part.isdigit() for part in bucket.split(".")):
        problem = "bucket names cannot be IP addresses"
    elif bucket.startswith("goog") or "google" in bucket or "g00gle" in bucket:
        problem = "bucket names cannot start with 'goog' or contain 'google'"
    if problem:
        raise PathError(f"invalid bucket name {bucket!r} in {uri!r}: {problem}")


def _check_object(obj: str, uri: str) -> None:
    if not obj:
        return
    if any(segment in ("..", ".") for segment in obj.split("/")):
        raise PathError(f"{uri!r} has a '.' or '..' segment: object paths must not step out of their prefix")
    if "\r" in obj or "\n" in obj:
        raise PathError(f"{uri!r}: object names cannot contain carriage returns or line feeds")
    if len(obj.encode("utf-8")) > _MAX_OBJECT_BYTES:
        raise PathError(f"{uri!r}: object names are at most {_MAX_OBJECT_BYTES} bytes of UTF-8")

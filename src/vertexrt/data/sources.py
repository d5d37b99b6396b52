"""Resolve what a dataset reads: files (local, ``/gcs/``, ``gs://``; a directory, a wildcard, a
comma-separated list) or a BigQuery table (``bq://project.dataset.table`` or ``project.dataset.table``).

Example:
    >>> expand_files("gs://b/export/training-*")
    [FileSource(uri='gs://b/export/training-00000-of-00002', size=1234), ...]
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from vertexrt.data.formats.base import FileSource
from vertexrt.errors import DataError, PathError, StorageError

_TABLE = re.compile(
    r"^(?P<project>(?:[a-z][a-z0-9.-]*[a-z0-9]:)?[a-z0-9](?:[a-z0-9-]*[a-z0-9])?)"
    r"\.(?P<dataset>[A-Za-z0-9_]{1,1024})\.(?P<table>[^./\s`]{1,1024})$"
)
_MAGIC = re.compile(r"[*?\[]")


@dataclass(frozen=True)
class TableSource:
    """A BigQuery table."""

    project: str
    dataset: str
    table: str

    @property
    def table_id(self) -> str:
        return f"{self.project}.{self.dataset}.{self.table}"


def is_bigquery(uri: str) -> bool:
    """True for ``bq://...``, or a bare ``project.dataset.table`` that is not an existing local path."""
    text = str(uri).strip()
    if text.startswith("bq://"):
        return True
    return bool(_TABLE.match(text)) and "/" not in text and not os.path.exists(text) and "," not in text


def parse_table(uri: str) -> TableSource:
    """``bq://project.dataset.table`` (or without the scheme) -> :class:`TableSource`.

    Raises:
        PathError: not of the form ``project.dataset.table``.
    """
    text = str(uri).strip()
    body = text[len("bq://") :] if text.startswith("bq://") else text
    body = body.replace("/", ".") if body.count("/") == 2 and "." not in body else body
    match = _TABLE.match(body)
    if not match:
        raise PathError(
            f"{text!r} is not a BigQuery table: expected bq://PROJECT.DATASET.TABLE "
            "(project ID in lowercase letters, digits and '-'; dataset of letters, digits and '_')"
        )
    return TableSource(match["project"], match["dataset"], match["table"])


def expand_files(uri: str | Sequence[str]) -> list[FileSource]:
    """The data files ``uri`` names, sorted by URI, with their sizes.

    Directories are listed recursively; names starting with ``_`` or ``.`` (``_SUCCESS``, ``.crc``) are
    skipped, and so are FIFOs, devices and sockets. Listing Cloud Storage runs under the listing deadline
    (``VERTEXRT_STORAGE_LIST_TIMEOUT``, :mod:`vertexrt.retries`). Raises :class:`~vertexrt.errors.DataError`
    when a part matches no file or cannot be listed.
    """
    parts = [p.strip() for p in (uri.split(",") if isinstance(uri, str) else uri) if str(p).strip()]
    if not parts:
        raise DataError(f"no data location given ({uri!r}): pass a path, gs:// URI, wildcard or list")
    found: dict[str, FileSource] = {}
    for part in parts:
        for source in _expand_one(str(part)):
            found[source.uri] = source
    return [found[key] for key in sorted(found)]


def _expand_one(part: str) -> list[FileSource]:
    from vertexrt import paths, retries

    fs, path = paths.filesystem(part)
    local = paths.is_local_filesystem(fs)

    def ask(method: str, *args: Any, **kwargs: Any) -> Any:
        """``fs.method(...)``; on Cloud Storage under the listing deadline and retry policy."""
        if local:
            return getattr(fs, method)(*args, **kwargs)
        try:
            return retries.call("listing", part, getattr(fs, method), *args, kind="list", **kwargs)
        except StorageError as err:
            raise DataError(str(err)) from err

    def uri_of(p: str) -> str:
        return p if local else fs.unstrip_protocol(p)

    hint = "check the bucket name and that the job's service account can list and read it"
    try:
        if _MAGIC.search(path):
            entries = ask("glob", path, detail=True)
            files = [
                FileSource(uri_of(p), int(i.get("size") or 0), _version(i))
                for p, i in entries.items()
                if _is_file(i)
            ]
            if not files:
                raise DataError(f"no file matches {part!r}; check the pattern and the directory it names")
            return files
        try:
            info = ask("info", path)
        except FileNotFoundError:
            raise DataError(f"{part!r} does not exist; {hint}") from None
        if info.get("type") == "other":
            raise DataError(
                f"{part!r} is not a regular file (a FIFO, device or socket could block the reader forever): "
                "give data files"
            )
        if not _is_file(info):
            entries = ask("find", path, detail=True)
            files = [
                FileSource(uri_of(p), int(i.get("size") or 0), _version(i))
                for p, i in entries.items()
                if _is_file(i) and not _hidden(p[len(path) :])
            ]
            if not files:
                raise DataError(f"directory {part!r} holds no data files")
            return files
        return [FileSource(uri_of(path), int(info.get("size") or 0), _version(info))]
    except (DataError, PathError):
        raise
    except FileNotFoundError as err:
        raise DataError(f"cannot list {part!r}: {err}; {hint}") from None
    except (OSError, ValueError, RuntimeError) as err:
        raise DataError(f"cannot list {part!r}: {type(err).__name__}: {err}; {hint}") from None


def _is_file(info: dict[str, object]) -> bool:
    """A file or object: not a directory, nor a FIFO, device or socket (``"other"``: a read could block)."""
    return info.get("type") not in ("directory", "dir", "other")


def _version(info: dict[str, object]) -> str:
    """What changes when a file's content changes, even at the same size: the Cloud Storage object's CRC32C
    (an identical rewrite, e.g. data regenerated at each start, is the same data), else its generation, else
    the modification time (local disk, the FUSE mount)."""
    return str(info.get("crc32c") or info.get("generation") or info.get("mtime") or "")


def _hidden(relative: str) -> bool:
    return any(piece.startswith(("_", ".")) for piece in relative.split("/") if piece)

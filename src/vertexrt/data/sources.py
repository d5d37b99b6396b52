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

from vertexrt.data.formats import FileSource
from vertexrt.errors import DataError, PathError

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
    skipped. Raises :class:`~vertexrt.errors.DataError` when a part matches no file or cannot be listed.
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
    from vertexrt import paths

    fs, path = paths.filesystem(part)
    local = paths.is_local_filesystem(fs)

    def uri_of(p: str) -> str:
        return p if local else fs.unstrip_protocol(p)

    hint = "check the bucket name and that the job's service account can list and read it"
    try:
        if _MAGIC.search(path):
            entries = fs.glob(path, detail=True)
            files = [
                FileSource(uri_of(p), int(i.get("size") or 0)) for p, i in entries.items() if _is_file(i)
            ]
            if not files:
                raise DataError(f"no file matches {part!r}; check the pattern and the directory it names")
            return files
        try:
            info = fs.info(path)
        except FileNotFoundError:
            raise DataError(f"{part!r} does not exist; {hint}") from None
        if not _is_file(info):
            entries = fs.find(path, detail=True)
            files = [
                FileSource(uri_of(p), int(i.get("size") or 0))
                for p, i in entries.items()
                if _is_file(i) and not _hidden(p[len(path) :])
            ]
            if not files:
                raise DataError(f"directory {part!r} holds no data files")
            return files
        return [FileSource(uri_of(path), int(info.get("size") or 0))]
    except (DataError, PathError):
        raise
    except FileNotFoundError as err:
        raise DataError(f"cannot list {part!r}: {err}; {hint}") from None
    except (OSError, ValueError, RuntimeError) as err:
        raise DataError(f"cannot list {part!r}: {type(err).__name__}: {err}; {hint}") from None


def _is_file(info: dict[str, object]) -> bool:
    return info.get("type") not in ("directory", "dir")


def _hidden(relative: str) -> bool:
    return any(piece.startswith(("_", ".")) for piece in relative.split("/") if piece)

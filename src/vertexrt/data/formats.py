"""The record-format protocol every reader implements, and the error policy they share.

A format turns one *source* (a file, or a BigQuery table) into chunks of raw records, ``(position, raws)``,
where ``position`` is where ``raws[0]`` starts: a byte offset (in the decompressed stream) for files, a row
index for Parquet and BigQuery. Starting a read at a position a chunk reported, and skipping ``k`` raw
records, lands on the same record whatever the chunk boundaries were — that is what makes a cursor exact.
``decode`` turns the raws that this reader keeps into records (dicts, bytes).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

from vertexrt.errors import DataError

logger = logging.getLogger(__name__)

OnError = Literal["raise", "skip"]


class _Skipped:
    """Placeholder ``decode`` leaves where a bad record was skipped, so positions stay countable."""

    def __repr__(self) -> str:
        return "SKIPPED"


SKIPPED: Any = _Skipped()


@dataclass(frozen=True)
class FileSource:
    """One data file: a URI that :func:`vertexrt.paths.open` accepts, and its size in bytes."""

    uri: str
    size: int


class Errors:
    """What to do with a malformed record: raise :class:`~vertexrt.errors.DataError`, or skip and count."""

    def __init__(self, on_error: OnError = "raise"):
        if on_error not in ("raise", "skip"):
            raise DataError(f"on_error={on_error!r}: use 'raise' or 'skip'")
        self.on_error = on_error
        self.skipped = 0

    def bad(self, message: str) -> None:
        """Report a malformed record: raises with ``on_error='raise'``, else logs and counts it."""
        if self.on_error == "raise":
            raise DataError(message + "; or pass on_error='skip' to skip and count bad records")
        self.skipped += 1
        logger.warning("skipping bad record: %s", message)


class Format:
    """Base class of record formats. Subclasses are small, picklable option holders."""

    name: ClassVar[str] = ""

    def read(
        self, source: Any, start: int, end: int | None, errors: Errors
    ) -> Iterator[tuple[int, list[Any]]]:
        """Chunks ``(position of raws[0], raws)`` from ``start`` (a position this format reported, or 0)."""
        raise NotImplementedError

    def decode(self, raws: list[Any], source: Any, position: int, errors: Errors) -> list[Any]:
        """Records from raw records, one per raw (identity by default); a skipped bad one is ``SKIPPED``."""
        return raws

    def count(self, source: Any, errors: Errors) -> int:
        """Number of records in ``source`` (reads it unless the format has metadata)."""
        return sum(len(raws) for _, raws in self.read(source, 0, None, errors))

    def __repr__(self) -> str:
        fields = ", ".join(f"{k}={v!r}" for k, v in vars(self).items())
        return f"{type(self).__name__}({fields})"

    def __eq__(self, other: object) -> bool:
        return type(self) is type(other) and vars(self) == vars(other)

    def __hash__(self) -> int:
        return hash((type(self).__name__, repr(self)))


def format_named(name: str) -> Format:
    """The format for a name or extension: jsonl, csv, tsv, tfrecord, parquet or bigquery."""
    key = name.lower().lstrip(".")
    if key in ("jsonl", "json", "ndjson", "jsonlines"):
        from vertexrt.data.jsonl import JSONL

        return JSONL()
    if key in ("csv", "tsv"):
        from vertexrt.data.csv import CSV

        return CSV(delimiter="\t" if key == "tsv" else ",")
    if key in ("tfrecord", "tfrecords", "tfrec", "tf_record"):
        from vertexrt.data.tfrecord import TFRecord

        return TFRecord()
    if key in ("parquet", "pq"):
        from vertexrt.data.parquet import Parquet

        return Parquet()
    if key in ("bigquery", "bq"):
        from vertexrt.data.bigquery import BigQuery

        return BigQuery()
    raise DataError(
        f"unknown data format {name!r}: use jsonl, csv, tsv, tfrecord, parquet or bigquery "
        "(or pass a format object such as vertexrt.data.CSV(...))"
    )


def format_for_uri(uri: str) -> Format | None:
    """The format named by ``uri``'s extension (a ``.gz``/``.zz`` suffix is looked through), or None."""
    name = uri.rsplit("/", 1)[-1].lower()
    for suffix in (".gz", ".gzip", ".zz", ".zlib"):
        if name.endswith(suffix):
            name = name[: -len(suffix)]
    if "." not in name:
        return None
    try:
        return format_named(name.rsplit(".", 1)[-1])
    except DataError:
        return None

"""Format names and file extensions to :class:`~vertexrt.data.formats.base.Format` objects.

The registry imports the formats (lazily: a format's reader libraries load when it is named); the formats
import only :mod:`vertexrt.data.formats.base`, never this module.
"""

from __future__ import annotations

from vertexrt.data.formats.base import Format
from vertexrt.errors import DataError


def format_named(name: str) -> Format:
    """The format for a name or extension: jsonl, csv, tsv, tfrecord, parquet, bigquery, files (also an
    image / audio / video extension such as jpg, png, wav, mp4), or a Vertex managed-dataset export:
    vertex-image, vertex-text, vertex-video."""
    key = name.lower().lstrip(".")
    if key in ("jsonl", "json", "ndjson", "jsonlines"):
        from vertexrt.data.formats.jsonl import JSONL

        return JSONL()
    if key in ("csv", "tsv"):
        from vertexrt.data.formats.csv import CSV

        return CSV(delimiter="\t" if key == "tsv" else ",")
    if key in ("tfrecord", "tfrecords", "tfrec", "tf_record"):
        from vertexrt.data.formats.tfrecord import TFRecord

        return TFRecord()
    if key in ("parquet", "pq"):
        from vertexrt.data.formats.parquet import Parquet

        return Parquet()
    if key == "files" or key in _binary_extensions():
        from vertexrt.data.formats.files import Files

        return Files()
    if key in ("bigquery", "bq"):
        from vertexrt.data.formats.bigquery import BigQuery

        return BigQuery()
    from vertexrt.data.formats.managed import FORMATS as MANAGED

    if key in MANAGED:
        return MANAGED[key]()
    raise DataError(
        f"unknown data format {name!r}: use jsonl, csv, tsv, tfrecord, parquet, bigquery, files, "
        "vertex-image, vertex-text or vertex-video "
        "(or pass a format object such as vertexrt.data.CSV(...))"
    )


def _binary_extensions() -> frozenset[str]:
    from vertexrt.data.formats.files import EXTENSIONS

    return EXTENSIONS


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

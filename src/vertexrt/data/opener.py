"""Opening a dataset: files or a BigQuery table named by a URI (or the Vertex ``AIP_*_DATA_URI`` of a
split), its format named, guessed from the extension or from ``AIP_DATA_FORMAT``.

Example:
    >>> ds = open_dataset("gs://my-bucket/export/training-*.jsonl", shuffle=True, seed=1)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

from vertexrt.data.dataset import Dataset, Equalize
from vertexrt.data.formats.base import FileSource, Format, OnError
from vertexrt.data.formats.registry import format_for_uri, format_named
from vertexrt.data.sources import TableSource, expand_files, is_bigquery, parse_table
from vertexrt.errors import ConfigError, DataError


def open_dataset(
    uri: str | Sequence[str] | None = None,
    format: str | Format | None = None,  # noqa: A002 - the natural name for it
    *,
    shuffle: bool = True,
    seed: int = 0,
    shuffle_buffer: int = 10_000,
    rank: int | None = None,
    world_size: int | None = None,
    equalize: Equalize | None = "auto",
    batch_size: int = 1,
    on_error: OnError = "raise",
    prefetch: int | None = None,
    split: Literal["training", "validation", "test"] = "training",
    columnar: bool | Literal["arrow"] = False,
) -> Dataset:
    """Open files or a BigQuery table as a sharded, shuffled, exactly-once, resumable record stream.

    Args:
        uri: a local path, ``/gcs/`` path or ``gs://`` URI (a file, a directory, a wildcard, or a
            comma-separated list), or ``bq://project.dataset.table``. Default: ``AIP_<SPLIT>_DATA_URI``.
            A table is read through the BigQuery Storage Read API: the chief opens one read session at
            ``prepare()`` or the first iteration and shares its streams with every rank (over
            ``torch.distributed`` when several ranks); ``list_rows`` where the API is not enabled, or with
            ``BigQuery(storage_api=False)``.
        format: ``"jsonl"``, ``"csv"``, ``"tfrecord"``, ``"parquet"``, ``"bigquery"``, ``"files"`` (whole
            binary files such as images, see :class:`~vertexrt.data.formats.files.Files`) or a format object
            (``CSV(types=...)``, ``TFRecord(example=True)``, ...). Default: ``AIP_DATA_FORMAT`` for the
            environment's URI, else the file extension.
        shuffle: shuffle the file order and, within blocks of ``shuffle_buffer`` records, the records;
            seeded by ``(seed, epoch)``.
        rank, world_size: this replica; default torch.distributed when initialised, else the cluster.
        equalize: make every reader yield the same number of records, a multiple of ``batch_size``, so
            every replica runs the same number of batches (unequal batch counts hang DDP). The default
            ``"auto"`` is ``"drop_remainder"`` when there are several replicas (each reads the smallest share,
            rounded down to whole batches; at most ``readers x batch_size`` records of an epoch go unread)
            and nothing with one. ``"pad"`` repeats records up to the largest share instead; ``None`` (or
            ``"off"``) reads every record exactly once with unequal shares. Equalizing counts every file's
            records once per job (a read of each file unless the format has metadata, shared out between
            the ranks, cached for restarts: see :mod:`vertexrt.data.counting`); ``ds.equalized`` says
            whether it is in force.
        on_error: ``"raise"`` a :class:`~vertexrt.errors.DataError` naming file and line/byte, or ``"skip"``
            bad records and count them in ``ds.skipped``.
        prefetch: chunks read ahead by a background thread; default 2 for Cloud Storage (``gs://``,
            ``/gcs/``) and BigQuery, 0 (read in the iterating thread) for local disk, where a second
            Python thread only competes for the GIL.
        split: which ``AIP_*_DATA_URI`` to use when ``uri`` is None.
        columnar: yield column batches, ``{column: numpy array}`` of ``batch_size`` rows (the last one of
            an unequalized epoch may be shorter), read by Arrow without a per-row step: Parquet, CSV
            (pyarrow's reader; columns without ``types`` get Arrow's inferred types) and JSONL. Sharding,
            shuffle (rows are permuted within and across the ``shuffle_buffer`` rows read) and the exact
            cursor are those of the row path; resuming a CSV or JSONL file mid-way re-reads it up to the
            cursor. ``as_torch()`` / ``as_tf()`` hand the columns over as tensors.
            ``columnar="arrow"`` yields the same batches as ``pyarrow.RecordBatch`` with no numpy
            conversion (the fastest: for Arrow-native pipelines, or string / list columns you process
            yourself); BigQuery Storage Read streams too. ``as_torch()`` / ``as_tf()`` convert its batches
            as for ``True`` (numeric columns zero-copy, strings as numpy object arrays / ``tf.string``).
            Files whose columns or types differ raise a DataError naming the file and the column.

    Example:
        >>> ds = open_dataset("gs://my-bucket/export/training-*", format="jsonl", seed=7)
        >>> for record in ds: ...
    """
    env_format = None
    if uri is None:
        from vertexrt.env import environment

        env = environment()
        uri = {
            "training": env.training_data_uri,
            "validation": env.validation_data_uri,
            "test": env.test_data_uri,
        }.get(split)
        if split not in ("training", "validation", "test"):
            raise ConfigError(f"split={split!r}: use 'training', 'validation' or 'test'")
        if not uri:
            raise ConfigError(
                f"no uri given and AIP_{split.upper()}_DATA_URI is not set: pass uri=..., run with a "
                f"Vertex managed dataset, or simulate one with `vertexrt local-run --{split}-data URI`"
            )
        env_format = env.data_format
    fmt = _format(uri, format, env_format)
    sources: Sequence[FileSource] | TableSource
    if fmt is not None and fmt.name == "bigquery":
        if not isinstance(uri, str):
            raise ConfigError("a BigQuery source is one table URI, not a list")
        sources = parse_table(uri)
    else:
        sources = expand_files(uri)
        fmt = fmt or _guess(sources, uri)
        if sources and all(s.size == 0 for s in sources):
            raise DataError(
                f"every file of {uri!r} is empty ({len(sources)} files): there is no data to read"
            )
    return Dataset(
        sources,
        fmt,
        shuffle=shuffle,
        seed=seed,
        shuffle_buffer=shuffle_buffer,
        rank=rank,
        world_size=world_size,
        equalize=equalize,
        batch_size=batch_size,
        on_error=on_error,
        prefetch=prefetch,
        columnar=columnar,
    )


def validation_dataset(**kwargs: Any) -> Dataset:
    """:func:`open_dataset` on ``AIP_VALIDATION_DATA_URI`` (unshuffled unless ``shuffle=True``)."""
    kwargs.setdefault("shuffle", False)
    return open_dataset(split="validation", **kwargs)


def test_dataset(**kwargs: Any) -> Dataset:
    """:func:`open_dataset` on ``AIP_TEST_DATA_URI`` (unshuffled unless ``shuffle=True``)."""
    kwargs.setdefault("shuffle", False)
    return open_dataset(split="test", **kwargs)


test_dataset.__test__ = False  # type: ignore[attr-defined]  # not a pytest test


def _format(uri: str | Sequence[str], explicit: str | Format | None, env_format: str | None) -> Format | None:
    """The format named by the caller, the URI (bq://, extension) or AIP_DATA_FORMAT; None: see the files."""
    if isinstance(explicit, Format):
        return explicit
    if explicit is not None:
        return format_named(explicit)
    if isinstance(uri, str) and is_bigquery(uri):
        return format_named("bigquery")
    if env_format:
        return format_named(env_format)
    first = (uri.split(",") if isinstance(uri, str) else list(uri))[0].strip()
    return format_for_uri(first)


def _guess(sources: Sequence[FileSource], uri: str | Sequence[str]) -> Format:
    guessed = format_for_uri(sources[0].uri) if sources else None
    if guessed is None:
        raise ConfigError(
            f"cannot tell the data format of {uri!r} from its extension: pass format='jsonl' (or csv, "
            "tfrecord, parquet, bigquery, files) or set AIP_DATA_FORMAT"
        )
    return guessed

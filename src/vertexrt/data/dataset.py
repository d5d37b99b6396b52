"""The dataset object: iteration, epochs, exact-resume state, and the framework adapters.

Example:
    >>> ds = open_dataset("gs://my-bucket/export/training-*.jsonl", shuffle=True, seed=1)
    >>> ds.set_epoch(0)
    >>> for record in ds: ...
    >>> state = ds.state_dict()         # small JSON; put it in the checkpoint
    >>> ds.load_state_dict(state)       # in a fresh process: continues with the next unseen record
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any, Literal

from vertexrt.data.cursor import Chunk, Cursor, StreamSpec, chunks
from vertexrt.data.formats import Errors, FileSource, Format, OnError, format_for_uri, format_named
from vertexrt.data.prefetch import Prefetcher
from vertexrt.data.sharding import (
    Topology,
    Unit,
    assign,
    balanced,
    dataloader_worker,
    epoch_order,
    equalized,
    reader_counts,
    replica,
)
from vertexrt.data.sources import TableSource, expand_files, is_bigquery, parse_table
from vertexrt.errors import ConfigError, DataError

if TYPE_CHECKING:
    import tensorflow as tf

    from vertexrt.data.torch import TorchIterable

logger = logging.getLogger(__name__)

STATE_VERSION = 1
Equalize = Literal["drop_remainder", "pad"]


class Dataset:
    """A sharded, shuffled, resumable stream of records; build it with :func:`open_dataset`.

    Iterating yields the rest of the current epoch for this process's reader; when the epoch is
    exhausted the dataset moves to the next one (``set_epoch`` also selects it explicitly).
    """

    def __init__(
        self,
        sources: Sequence[FileSource] | TableSource,
        fmt: Format,
        *,
        shuffle: bool = True,
        seed: int = 0,
        shuffle_buffer: int = 10_000,
        rank: int | None = None,
        world_size: int | None = None,
        equalize: Equalize | None = None,
        batch_size: int = 1,
        on_error: OnError = "raise",
        prefetch: int | None = None,
    ):
        if int(seed) < 0:
            raise ConfigError(f"seed={seed} must be >= 0")
        if batch_size < 1:
            raise ConfigError(f"batch_size={batch_size} must be >= 1")
        equalized([0], equalize, batch_size)  # validates the name
        self.sources = sources
        self.format = fmt
        self.shuffle = bool(shuffle)
        self.seed = int(seed)
        self.block_size = int(shuffle_buffer) if shuffle and shuffle_buffer > 1 else 1
        self.equalize = equalize
        self.batch_size = int(batch_size)
        self.prefetch = _default_prefetch(sources) if prefetch is None else int(prefetch)
        self._errors = Errors(on_error)
        self._rank_arg = (rank, world_size)
        if rank is not None or world_size is not None:
            replica(rank, world_size)  # validate early
        self._replica: tuple[int, int] | None = None
        self._worker: tuple[int, int] | None = None
        self._counts: dict[int, int] = {}
        self._epoch = 0
        self._cursors: dict[int, Cursor] = {}
        self._readers: int | None = None
        self._live: tuple[Chunk, Iterator[Any]] | None = None
        self._token: object = None
        self._fingerprint: str | None = None

    # -- public API ---------------------------------------------------------------------------------
    @property
    def epoch(self) -> int:
        """The epoch the next iteration reads."""
        return self._epoch

    @property
    def skipped(self) -> int:
        """Bad records skipped so far in this process (``on_error="skip"``)."""
        return self._errors.skipped

    @property
    def files(self) -> list[str]:
        """The data files (empty for a BigQuery table)."""
        return [] if isinstance(self.sources, TableSource) else [s.uri for s in self.sources]

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch to read (its file order and shuffle depend on it).

        Setting the epoch a loaded state is in keeps that state's position, so
        ``load_state_dict(s); set_epoch(s["epoch"])`` resumes mid-epoch.
        """
        epoch = int(epoch)
        if epoch < 0:
            raise ConfigError(f"set_epoch({epoch}): epochs are >= 0")
        if epoch != self._epoch:
            self._epoch = epoch
            self._cursors = {}
            self._live = None
            self._token = None

    def topology(self) -> Topology:
        """This process's reader: replica (rank, world size) x DataLoader worker."""
        if self._replica is None:
            self._replica = replica(*self._rank_arg)
        rank, world = self._replica
        worker, workers = self._worker or dataloader_worker()
        return Topology(rank, world, worker, workers)

    def count(self) -> int:
        """Records in the whole dataset (reads every file once unless the format has metadata)."""
        units = self._units(1)
        return sum(self._unit_counts(units))

    def __iter__(self) -> Iterator[Any]:
        topo = self.topology()
        if self._cursors and self._readers not in (None, topo.readers):
            raise ConfigError(
                f"this data state was saved with {self._readers} readers (world_size x DataLoader workers) "
                f"but this job has {topo.readers}: resume mid-epoch with the same topology, or from an "
                "epoch start"
            )
        spec = self._spec(topo)
        cursor = self._cursors.get(topo.reader, Cursor())
        errors = self._errors
        token = object()
        self._token = token
        self._readers = topo.readers
        if self.prefetch > 0:
            source: Iterator[Chunk] = Prefetcher(lambda: chunks(spec, cursor, errors), self.prefetch)
        else:
            source = chunks(spec, cursor, errors)
        decode = self.format.decoder()
        finished = False
        try:
            for chunk in source:
                raws = chunk.records
                records = iter(raws)
                self._live = (chunk, records)
                if decode is None:
                    yield from records
                    continue
                while True:
                    try:
                        yield from map(decode, records)
                        break
                    except Exception as err:  # a record that does not decode: the iterator is past it
                        bad = raws[len(raws) - records.__length_hint__() - 1]  # type: ignore[attr-defined]
                        if not self.format.ignorable(bad):
                            errors.bad(self.format.describe(bad, chunk.origins, err))
            finished = True
        finally:
            if isinstance(source, Prefetcher):
                source.close()
            if self._token is token:
                if finished:
                    self._epoch += 1
                    self._cursors = {}
                else:
                    live = self._live_cursor()
                    if live is not None:
                        self._cursors[topo.reader] = live
                self._live = None
                self._token = None

    def state_dict(self) -> dict[str, Any]:
        """A small JSON-serializable cursor: epoch, per-reader position, shuffle block (O(1) in the data)."""
        cursors = dict(self._cursors)
        live = self._live_cursor()
        if live is not None:
            cursors[self.topology().reader] = live
        return {
            "version": STATE_VERSION,
            "epoch": self._epoch,
            "fingerprint": self.fingerprint(),
            "readers": self._readers if cursors else None,
            "cursors": {str(reader): cursor.to_dict() for reader, cursor in sorted(cursors.items())},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state`` (from :meth:`state_dict`) with the next unseen record.

        Raises:
            DataError: the state belongs to other data or other shuffle/sharding options.
        """
        if not isinstance(state, dict) or state.get("version") != STATE_VERSION:
            raise DataError(f"not a vertexrt data state (version {STATE_VERSION}): {str(state)[:200]}")
        if state.get("fingerprint") != self.fingerprint():
            raise DataError(
                "this data state was saved for different data or options (files, sizes, format, shuffle, "
                "seed, shuffle_buffer, equalize); open the dataset exactly as when the state was saved"
            )
        self._epoch = int(state["epoch"])
        self._cursors = {int(k): Cursor.from_dict(v) for k, v in state.get("cursors", {}).items()}
        self._readers = state.get("readers")
        self._live = None
        self._token = None

    def fingerprint(self) -> str:
        """A short hash of what the cursor's meaning depends on (data files, format, options)."""
        if self._fingerprint is None:
            self._fingerprint = self._compute_fingerprint()
        return self._fingerprint

    def _compute_fingerprint(self) -> str:
        if isinstance(self.sources, TableSource):
            data: Any = self.sources.table_id
        else:
            data = [(s.uri, s.size) for s in self.sources]
        blob = json.dumps(
            [
                repr(self.format),
                data,
                self.shuffle,
                self.seed,
                self.block_size,
                self.equalize,
                self.batch_size,
            ],
            sort_keys=True,
            default=str,
        )
        return hashlib.sha1(blob.encode()).hexdigest()[:16]

    def as_torch(self) -> TorchIterable:
        """A ``torch.utils.data.IterableDataset`` for a DataLoader (``num_workers >= 0``); see
        :class:`vertexrt.data.torch.TorchIterable`."""
        from vertexrt.data.torch import TorchIterable

        return TorchIterable(self)

    def as_tf(self, output_signature: Any = None) -> tf.data.Dataset:
        """A ``tf.data.Dataset`` over this dataset (signature inferred from the first record if omitted)."""
        from vertexrt.data.tf import to_tf

        return to_tf(self, output_signature)

    # -- internals ----------------------------------------------------------------------------------
    def _live_cursor(self) -> Cursor | None:
        if self._live is None:
            return None
        chunk, records = self._live
        consumed = len(chunk.records) - records.__length_hint__()  # type: ignore[attr-defined]
        return chunk.cursor_after(consumed)

    def _units(self, readers: int) -> list[Unit]:
        if isinstance(self.sources, TableSource):
            rows = self._table_rows()
            parts = max(1, readers)
            return [Unit(0, rows * i // parts, rows * (i + 1) // parts) for i in range(parts)]
        return [Unit(i) for i in range(len(self.sources))]

    def _table_rows(self) -> int:
        if 0 not in self._counts:
            self._counts[0] = self.format.count(self.sources, self._errors)
        return self._counts[0]

    def _unit_counts(self, units: Sequence[Unit]) -> list[int]:
        out = []
        for unit in units:
            if unit.end is not None:
                out.append(unit.end - unit.start)
                continue
            if unit.source not in self._counts:
                self._counts[unit.source] = self.format.count(self.sources[unit.source], self._errors)  # type: ignore[index]
            out.append(self._counts[unit.source])
        return out

    def prepare(self) -> None:
        """Do the work every reader shares (record counts for ``equalize``) once, before forking workers."""
        if self.equalize is not None:
            self._unit_counts(self._units(1))

    def _spec(self, topo: Topology) -> StreamSpec:
        order = epoch_order(self._units(topo.readers), self.seed, self._epoch, self.shuffle)
        target = None
        if self.equalize is not None and not isinstance(self.sources, TableSource):
            unit_counts = self._unit_counts(order)
            units, stride, offset = balanced(order, unit_counts, topo.reader, topo.readers), 1, 0
            total = sum(unit_counts)
            counts = [total // topo.readers + (r < total % topo.readers) for r in range(topo.readers)]
            target = equalized(counts, self.equalize, self.batch_size)
        else:
            units, stride, offset = assign(order, topo.reader, topo.readers)
            if self.equalize is not None:
                counts = reader_counts(order, self._unit_counts(order), topo.readers)
                target = equalized(counts, self.equalize, self.batch_size)
        return StreamSpec(
            fmt=self.format,
            sources=[self.sources] if isinstance(self.sources, TableSource) else self.sources,
            units=units,
            stride=stride,
            offset=offset,
            pad_units=order,
            target=target,
            block_size=self.block_size,
            seed=self.seed,
            epoch=self._epoch,
            reader=topo.reader,
            readers=topo.readers,
        )

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_live"] = None
        state["_token"] = None
        return state

    def __repr__(self) -> str:
        what = (
            self.sources.table_id if isinstance(self.sources, TableSource) else f"{len(self.sources)} files"
        )
        return f"Dataset({what}, format={self.format!r}, shuffle={self.shuffle}, seed={self.seed})"


def open_dataset(
    uri: str | Sequence[str] | None = None,
    format: str | Format | None = None,  # noqa: A002 - the natural name for it
    *,
    shuffle: bool = True,
    seed: int = 0,
    shuffle_buffer: int = 10_000,
    rank: int | None = None,
    world_size: int | None = None,
    equalize: Equalize | None = None,
    batch_size: int = 1,
    on_error: OnError = "raise",
    prefetch: int | None = None,
    split: Literal["training", "validation", "test"] = "training",
) -> Dataset:
    """Open files or a BigQuery table as a sharded, shuffled, exactly-once, resumable record stream.

    Args:
        uri: a local path, ``/gcs/`` path or ``gs://`` URI (a file, a directory, a wildcard, or a
            comma-separated list), or ``bq://project.dataset.table``. Default: ``AIP_<SPLIT>_DATA_URI``.
        format: ``"jsonl"``, ``"csv"``, ``"tfrecord"``, ``"parquet"``, ``"bigquery"`` or a format object
            (``CSV(types=...)``, ``TFRecord(example=True)``, ...). Default: ``AIP_DATA_FORMAT`` for the
            environment's URI, else the file extension.
        shuffle: shuffle the file order and, within blocks of ``shuffle_buffer`` records, the records;
            seeded by ``(seed, epoch)``.
        rank, world_size: this replica; default torch.distributed when initialised, else the cluster.
        equalize: ``"drop_remainder"`` or ``"pad"`` so every reader yields the same number of records,
            a multiple of ``batch_size`` (unequal batch counts hang DDP). Counts every file's records once.
        on_error: ``"raise"`` a :class:`~vertexrt.errors.DataError` naming file and line/byte, or ``"skip"``
            bad records and count them in ``ds.skipped``.
        prefetch: chunks read ahead by a background thread; default 2 for Cloud Storage (``gs://``,
            ``/gcs/``) and BigQuery, 0 (read in the iterating thread) for local disk, where a second
            Python thread only competes for the GIL.
        split: which ``AIP_*_DATA_URI`` to use when ``uri`` is None.

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
                f"no uri given and AIP_{split.upper()}_DATA_URI is not set: pass uri=... or run with a "
                "Vertex managed dataset"
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
    )


def _default_prefetch(sources: Sequence[FileSource] | TableSource) -> int:
    from vertexrt.paths import storage_kind

    if isinstance(sources, TableSource) or any(storage_kind(s.uri) != "local" for s in sources):
        return 2
    return 0


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
            "tfrecord, parquet, bigquery) or set AIP_DATA_FORMAT"
        )
    return guessed

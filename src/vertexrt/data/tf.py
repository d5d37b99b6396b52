"""``tf.data`` adapter: a ``tf.data.Dataset`` fed by the vertexrt reader.

Example:
    >>> ds = open_dataset("gs://b/train-*.jsonl").as_tf(
    ...     {"x": tf.TensorSpec((), tf.float32), "label": tf.TensorSpec((), tf.int64)})
    >>> for batch in ds.batch(256).prefetch(2): ...
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import tensorflow as tf

from vertexrt.errors import DataError

if TYPE_CHECKING:
    from vertexrt.data.dataset import Dataset


def spec_of(value: Any, where: str = "record") -> Any:
    """The ``tf.TensorSpec`` (or dict of them) that fits a record like ``value``."""
    if isinstance(value, dict):
        return {str(k): spec_of(v, f"{where}[{k!r}]") for k, v in value.items()}
    if type(value).__module__ == "numpy" and hasattr(value, "dtype") and value.ndim:  # a column batch
        dtype = tf.string if value.dtype.kind in "OSU" else tf.as_dtype(value.dtype)
        return tf.TensorSpec((None, *value.shape[1:]), dtype)
    if isinstance(value, bytes | str):
        return tf.TensorSpec((), tf.string)
    if isinstance(value, bool):
        return tf.TensorSpec((), tf.bool)
    if isinstance(value, int):
        return tf.TensorSpec((), tf.int64)
    if isinstance(value, float):
        return tf.TensorSpec((), tf.float32)
    if isinstance(value, list | tuple):
        if not value:
            raise DataError(f"{where} is an empty list: pass output_signature=... to as_tf()")
        inner = spec_of(value[0], where)
        return tf.TensorSpec((None,), inner.dtype)
    raise DataError(
        f"{where} has type {type(value).__name__}, which as_tf() cannot infer: pass output_signature"
    )


def to_tf(dataset: Dataset, output_signature: Any = None) -> tf.data.Dataset:
    """Wrap ``dataset`` in ``tf.data.Dataset.from_generator``; infer the signature from the first record.

    vertexrt has already given this replica its share, so the result carries
    ``AutoShardPolicy.OFF``: under ``tf.distribute`` (``MultiWorkerMirroredStrategy``, Keras ``fit``) the
    default AUTO policy would otherwise shard the generator's records again and drop half of them with
    two workers. When every epoch has a known length (``equalize`` in force, and no epoch half read) the
    dataset also has that cardinality, so Keras knows the steps per epoch, and every pass over it reads
    one whole epoch from its start: a pass cut short (``take``, Keras stopping at the cardinality while
    tf.data read ahead) leaves the rest of its epoch unread and the next pass reads the next epoch.

    Example:
        >>> ds = open_dataset("gs://b/train-*.jsonl").as_tf()
        >>> model.fit(ds.batch(64), epochs=3)
    """
    if output_signature is None:
        probe = _first_record(dataset)
        output_signature = spec_of(probe)
    length = None if dataset.mid_epoch else dataset.epoch_length()
    passes = _Passes(dataset) if length is not None else (lambda: _records(dataset))
    out = tf.data.Dataset.from_generator(passes, output_signature=output_signature)
    if length is not None:
        out = out.apply(tf.data.experimental.assert_cardinality(length))
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.OFF
    return out.with_options(options)


class _Passes:
    """The generator function of an ``as_tf()`` dataset with a cardinality: each pass starts an epoch."""

    def __init__(self, dataset: Dataset):
        self.dataset = dataset
        self.began: int | None = None  # the epoch the previous pass started

    def __call__(self) -> Iterator[Any]:
        dataset = self.dataset
        if self.began is not None and dataset.epoch == self.began:  # the previous pass was cut short
            dataset.set_epoch(self.began + 1)
        elif dataset.mid_epoch:
            raise DataError(
                f"{dataset!r} is mid-epoch (a state loaded, or records read) after as_tf() asserted the "
                "epoch's cardinality: call load_state_dict() before as_tf() so that the resumed first pass "
                "carries no cardinality, or set_epoch() to start an epoch"
            )
        self.began = dataset.epoch
        return _records(dataset)


def _records(dataset: Dataset) -> Iterator[Any]:
    """Iterate ``dataset``; column batches as numpy dicts that tf.data takes (``columns.tensor_ready``:
    TIMESTAMP / DATE as int64 microseconds / days since the epoch, NULL integers as 0); records with their
    timestamps, dates and decimals as the same numbers, a missing value refused naming its column
    (``row_values.tensor_value``)."""
    if dataset.columnar:
        from vertexrt.data.columns import numpy_batch, tensor_ready

        batches = map(numpy_batch, iter(dataset)) if dataset.arrow else iter(dataset)
        return ({name: tensor_ready(column) for name, column in batch.items()} for batch in batches)
    return map(_row_ready, iter(dataset))


def _row_ready(record: Any) -> Any:
    from vertexrt.data.row_values import tensor_value

    if isinstance(record, dict):
        return {key: tensor_value(value, str(key)) for key, value in record.items()}
    return tensor_value(record, "record")


def _first_record(dataset: Dataset) -> Any:
    for record in _records(dataset.copy_at_epoch_start()):
        return record
    raise DataError(f"{dataset!r} has no records to infer a signature from: pass output_signature=...")

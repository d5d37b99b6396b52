"""``tf.data`` adapter: a ``tf.data.Dataset`` fed by the vertexrt reader.

Example:
    >>> ds = open_dataset("gs://b/train-*.jsonl").as_tf(
    ...     {"x": tf.TensorSpec((), tf.float32), "label": tf.TensorSpec((), tf.int64)})
    >>> for batch in ds.batch(256).prefetch(2): ...
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import tensorflow as tf

from vertexrt.errors import DataError

if TYPE_CHECKING:
    from vertexrt.data.dataset import Dataset


def spec_of(value: Any, where: str = "record") -> Any:
    """The ``tf.TensorSpec`` (or dict of them) that fits a record like ``value``."""
    if isinstance(value, dict):
        return {str(k): spec_of(v, f"{where}[{k!r}]") for k, v in value.items()}
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
    """Wrap ``dataset`` in ``tf.data.Dataset.from_generator``; infer the signature from the first record."""
    if output_signature is None:
        probe = _first_record(dataset)
        output_signature = spec_of(probe)
    return tf.data.Dataset.from_generator(lambda: iter(dataset), output_signature=output_signature)


def _first_record(dataset: Dataset) -> Any:
    import copy

    probe = copy.copy(dataset)
    probe.__dict__ = dataset.__getstate__()
    probe._cursors = {}
    probe.prefetch = 0
    for record in probe:
        return record
    raise DataError(f"{dataset!r} has no records to infer a signature from: pass output_signature=...")

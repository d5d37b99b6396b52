"""Streaming, sharded, exactly-once, resumable data readers for Cloud Storage and BigQuery.

Example:
    >>> import vertexrt.data
    >>> ds = vertexrt.data.open_dataset()          # AIP_TRAINING_DATA_URI, AIP_DATA_FORMAT
    >>> for epoch in range(3):
    ...     ds.set_epoch(epoch)
    ...     for record in ds: ...
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from vertexrt.data.bigquery import BigQuery
    from vertexrt.data.csv import CSV
    from vertexrt.data.dataset import Dataset, open_dataset, test_dataset, validation_dataset
    from vertexrt.data.example import decode_example, encode_example
    from vertexrt.data.jsonl import JSONL
    from vertexrt.data.parquet import Parquet
    from vertexrt.data.prefetch import Prefetcher
    from vertexrt.data.tfrecord import TFRecord, TFRecordWriter
    from vertexrt.data.torch import DataLoader

_EXPORTS = {
    "open_dataset": "vertexrt.data.dataset",
    "validation_dataset": "vertexrt.data.dataset",
    "test_dataset": "vertexrt.data.dataset",
    "Dataset": "vertexrt.data.dataset",
    "JSONL": "vertexrt.data.jsonl",
    "CSV": "vertexrt.data.csv",
    "TFRecord": "vertexrt.data.tfrecord",
    "TFRecordWriter": "vertexrt.data.tfrecord",
    "Parquet": "vertexrt.data.parquet",
    "BigQuery": "vertexrt.data.bigquery",
    "decode_example": "vertexrt.data.example",
    "encode_example": "vertexrt.data.example",
    "Prefetcher": "vertexrt.data.prefetch",
    "DataLoader": "vertexrt.data.torch",
}

__all__ = [
    "CSV",
    "JSONL",
    "BigQuery",
    "DataLoader",
    "Dataset",
    "Parquet",
    "Prefetcher",
    "TFRecord",
    "TFRecordWriter",
    "decode_example",
    "encode_example",
    "open_dataset",
    "test_dataset",
    "validation_dataset",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'vertexrt.data' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))

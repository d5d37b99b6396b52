"""Streaming, sharded, exactly-once, resumable data readers for Cloud Storage and BigQuery.

Example:
    >>> import vertexrt.data
    >>> ds = vertexrt.data.open_dataset()          # AIP_TRAINING_DATA_URI, AIP_DATA_FORMAT
    >>> for epoch in range(3):
    ...     ds.set_epoch(epoch)
    ...     for record in ds: ...
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from vertexrt._lazy import lazy_exports

if TYPE_CHECKING:
    from vertexrt.data.dataset import Dataset
    from vertexrt.data.example import decode_example, encode_example
    from vertexrt.data.formats.bigquery import BigQuery
    from vertexrt.data.formats.csv import CSV
    from vertexrt.data.formats.files import Files
    from vertexrt.data.formats.jsonl import JSONL
    from vertexrt.data.formats.managed import VertexImage, VertexText, VertexVideo
    from vertexrt.data.formats.parquet import Parquet
    from vertexrt.data.formats.tfrecord import TFRecord, TFRecordWriter
    from vertexrt.data.opener import open_dataset, test_dataset, validation_dataset
    from vertexrt.data.prefetch import Prefetcher
    from vertexrt.data.resumable import ResumableLoader, ResumableSampler, resumable_loader
    from vertexrt.data.resume_state import merge_states
    from vertexrt.data.torch import DataLoader

_EXPORTS = {
    "open_dataset": "vertexrt.data.opener",
    "merge_states": "vertexrt.data.resume_state",
    "VertexImage": "vertexrt.data.formats.managed",
    "VertexText": "vertexrt.data.formats.managed",
    "VertexVideo": "vertexrt.data.formats.managed",
    "validation_dataset": "vertexrt.data.opener",
    "test_dataset": "vertexrt.data.opener",
    "Dataset": "vertexrt.data.dataset",
    "JSONL": "vertexrt.data.formats.jsonl",
    "CSV": "vertexrt.data.formats.csv",
    "TFRecord": "vertexrt.data.formats.tfrecord",
    "TFRecordWriter": "vertexrt.data.formats.tfrecord",
    "Parquet": "vertexrt.data.formats.parquet",
    "Files": "vertexrt.data.formats.files",
    "BigQuery": "vertexrt.data.formats.bigquery",
    "decode_example": "vertexrt.data.example",
    "encode_example": "vertexrt.data.example",
    "Prefetcher": "vertexrt.data.prefetch",
    "DataLoader": "vertexrt.data.torch",
    "resumable_loader": "vertexrt.data.resumable",
    "ResumableLoader": "vertexrt.data.resumable",
    "ResumableSampler": "vertexrt.data.resumable",
}

__all__ = [
    "CSV",
    "JSONL",
    "BigQuery",
    "DataLoader",
    "Dataset",
    "Files",
    "Parquet",
    "Prefetcher",
    "ResumableLoader",
    "ResumableSampler",
    "TFRecord",
    "TFRecordWriter",
    "VertexImage",
    "VertexText",
    "VertexVideo",
    "decode_example",
    "encode_example",
    "merge_states",
    "open_dataset",
    "resumable_loader",
    "test_dataset",
    "validation_dataset",
]


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, listed=__all__)

"""Cluster sources, one class each, in detection order (see :func:`vertexrt.distributed.cluster`)."""

from __future__ import annotations

from vertexrt.distributed.cluster_sources.base import ClusterSource
from vertexrt.distributed.cluster_sources.cluster_spec import ClusterSpecSource
from vertexrt.distributed.cluster_sources.local import LocalSource
from vertexrt.distributed.cluster_sources.master import MasterSource
from vertexrt.distributed.cluster_sources.tf_config import TFConfigSource
from vertexrt.distributed.cluster_sources.torchrun import TorchrunSource

#: Detection order: the first source whose ``detect`` is true describes the process.
SOURCES: tuple[type[ClusterSource], ...] = (
    TorchrunSource,
    ClusterSpecSource,
    TFConfigSource,
    MasterSource,
    LocalSource,
)

__all__ = [
    "SOURCES",
    "ClusterSource",
    "ClusterSpecSource",
    "LocalSource",
    "MasterSource",
    "TFConfigSource",
    "TorchrunSource",
]

"""DCP's checkpoint ``Metadata`` as JSON in the step manifest, and back, validated: the manifest is untrusted.

:func:`encode_metadata` turns the ``Metadata`` DCP's planner made into JSON values; :func:`decode_metadata`
rebuilds it and checks every field against the step's shards (each location inside a shard, each tensor's
chunks tiling it exactly once, each leaf used once) before any byte is copied::

    extra = {"dcp": encode_metadata(metadata)}                  # saved with the manifest
    metadata = decode_metadata(manifest["dcp"], manifest, name=manifest_path)  # CheckpointCorruptError if bad
"""

from __future__ import annotations

import math
from typing import Any

from vertexrt.checkpoint import manifest as manifest_format
from vertexrt.errors import CheckpointCorruptError

#: The manifest key that marks a step written through DCP (and holds its metadata).
KEY = "dcp"


def encode_metadata(metadata: Any) -> dict[str, Any]:
    """DCP's ``Metadata`` as JSON values."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    entries = {}
    for fqn, meta in metadata.state_dict_metadata.items():
        if isinstance(meta, TensorStorageMetadata):
            entries[fqn] = {
                "t": "tensor",
                "dtype": str(meta.properties.dtype).removeprefix("torch."),
                "requires_grad": bool(meta.properties.requires_grad),
                "size": list(meta.size),
                "chunks": [[list(c.offsets), list(c.sizes)] for c in meta.chunks],
            }
        else:
            entries[fqn] = {"t": "bytes"}
    located = [
        [index.fqn, None if index.offset is None else list(index.offset), where]
        for index, where in (metadata.storage_data or {}).items()
    ]
    planner = {k: list(v) for k, v in (metadata.planner_data or {}).items()}
    return {"version": metadata.version, "entries": entries, "storage": located, "planner": planner}


def decode_metadata(value: Any, manifest: dict[str, Any], *, name: str) -> Any:
    """DCP's ``Metadata`` from :func:`encode_metadata`'s output, every field checked against the manifest.

    Raises:
        CheckpointCorruptError: a field out of schema, or a location outside the step's shards.
    """
    import torch
    from torch.distributed.checkpoint.metadata import (
        BytesStorageMetadata,
        ChunkStorageMetadata,
        Metadata,
        MetadataIndex,
        TensorProperties,
        TensorStorageMetadata,
    )

    def dims(v: Any) -> list[int]:
        if (
            not isinstance(v, list)
            or len(v) > manifest_format.MAX_DIMS
            or not all(_int(d) and d >= 0 for d in v)
        ):
            raise ValueError(f"dimensions {str(v)[:80]}")
        return v

    def dtype(v: Any) -> Any:
        found = getattr(torch, v, None) if isinstance(v, str) else None
        if not isinstance(found, torch.dtype):
            raise ValueError(f"dtype {str(v)[:40]!r}")
        return found

    leaves = {
        b["shard"]: b["tree"].get("v") if isinstance(b["tree"], dict) else None for b in manifest["shards"]
    }
    try:
        entries: dict[str, Any] = {}
        for fqn, e in value["entries"].items():
            if e["t"] == "bytes":
                entries[str(fqn)] = BytesStorageMetadata()
                continue
            props = TensorProperties(dtype=dtype(e["dtype"]), requires_grad=bool(e["requires_grad"]))
            chunks = [ChunkStorageMetadata(torch.Size(dims(o)), torch.Size(dims(s))) for o, s in e["chunks"]]
            entries[str(fqn)] = TensorStorageMetadata(props, torch.Size(dims(e["size"])), chunks)
        located = {}
        for fqn, offset, where in value["storage"]:
            shard, leaf = where["shard"], where["leaf"]
            nodes = leaves.get(shard) if _int(shard) else None
            if not _int(leaf) or not isinstance(nodes, list) or not 0 <= leaf < len(nodes):
                raise ValueError(f"location {str(where)[:80]} of {str(fqn)[:80]}")
            nbytes = sum(chunk[2] for chunk in nodes[leaf].get("chunks", []))
            if where["t"] == "tensor":
                kind = dtype(where["dtype"])
                if math.prod(dims(where["shape"])) * kind.itemsize != nbytes:
                    raise ValueError(f"{str(fqn)[:80]} of shape {where['shape']} in {nbytes} bytes")
                where = {**where, "dtype": kind}
            elif where["t"] != "bytes":
                raise ValueError(f"item kind {str(where['t'])[:40]}")
            held = nodes[leaf].get("of")  # what the leaf holds (steps written before it was recorded: None)
            if held is not None and held != [fqn, offset]:
                raise ValueError(f"{str(fqn)[:80]} at {offset} located in a leaf that holds {str(held)[:80]}")
            key = MetadataIndex(str(fqn), None if offset is None else torch.Size(dims(offset)))
            located[key] = where
        _check_layout(entries, located)
        planner = {str(k): tuple(v) for k, v in value["planner"].items()}
        if not all(isinstance(p, (str, int)) for path in planner.values() for p in path):
            raise ValueError("planner paths")
        version = value["version"]
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise CheckpointCorruptError(f"manifest {name} has invalid DCP metadata: {exc}", file=name) from None
    return Metadata(state_dict_metadata=entries, planner_data=planner, storage_data=located, version=version)


def _check_layout(entries: dict[str, Any], located: dict[Any, dict[str, Any]]) -> None:
    """The metadata against the tensors it describes, before any byte is copied: each tensor's chunks lie
    inside it and cover it without overlap, each chunk is stored as one leaf of the chunk's shape and the
    tensor's dtype, each stored item is described by exactly one entry, and no leaf is used twice.

    Raises:
        ValueError: naming the item and what disagrees (the caller makes it a CheckpointCorruptError).
    """
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex

    described = 0
    for fqn, entry in entries.items():
        if isinstance(entry, BytesStorageMetadata):
            where = located.get(MetadataIndex(fqn, None))
            if where is None or where["t"] != "bytes":
                raise ValueError(f"{fqn[:80]} is described as bytes but not stored as bytes")
            described += 1
            continue
        size, kind = list(entry.size), entry.properties.dtype
        boxes = []
        for chunk in entry.chunks:
            offsets, sizes = list(chunk.offsets), list(chunk.sizes)
            if len(offsets) != len(size) or len(sizes) != len(size):
                raise ValueError(f"{fqn[:80]} of size {size} has a chunk at {offsets} of size {sizes}")
            if any(o + n > s for o, n, s in zip(offsets, sizes, size, strict=True)):
                raise ValueError(
                    f"{fqn[:80]} of size {size} has a chunk at {offsets} of size {sizes} outside it"
                )
            where = located.get(MetadataIndex(fqn, chunk.offsets))
            if where is None or where["t"] != "tensor":
                raise ValueError(f"the chunk of {fqn[:80]} at {offsets} is not stored as a tensor")
            if list(where["shape"]) != sizes or where["dtype"] != kind:
                raise ValueError(
                    f"the chunk of {fqn[:80]} at {offsets} is {sizes} {kind}, but stored as {where['shape']} "
                    f"{where['dtype']}"
                )
            boxes.append((offsets, sizes))
        if not _tiles(size, boxes):
            raise ValueError(f"the chunks of {fqn[:80]} do not cover its size {size} exactly once")
        described += len(boxes)
    if described != len(located):
        raise ValueError(f"{len(located) - described} stored items are described by no entry (or twice)")
    leaves = {(where["shard"], where["leaf"]) for where in located.values()}
    if len(leaves) != len(located):
        raise ValueError("one stored leaf is located for several items")


def _tiles(size: list[int], boxes: list[tuple[list[int], list[int]]]) -> bool:
    """True when ``boxes`` ((offsets, sizes), each inside ``size``) cover ``size`` with no overlap: their
    volumes add up to it and no two intersect (a sweep along the first dimension)."""
    if sum(math.prod(n) for _, n in boxes) != math.prod(size):
        return False
    if not size:  # a scalar: one chunk of volume 1
        return True
    open_boxes: list[tuple[list[int], list[int]]] = []
    for offsets, sizes in sorted((b for b in boxes if math.prod(b[1])), key=lambda b: b[0]):
        open_boxes = [(o, n) for o, n in open_boxes if o[0] + n[0] > offsets[0]]
        for o, n in open_boxes:
            if all(a < c + m and c < a + k for a, k, c, m in zip(offsets, sizes, o, n, strict=True)):
                return False
        open_boxes.append((offsets, sizes))
    return True


def _int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)

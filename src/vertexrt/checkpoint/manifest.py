"""The manifest format: build one, and parse an untrusted one against a schema and bounds.

Format version 1 holds every shard's body (prefix, files, tree) inline. Version 2 (sharded saves) is a
step header: per shard only its prefix, data file sizes and a reference to its body file
(``{"name", "size", "crc32c"}``), which the rank restoring that shard reads and checks
(:func:`parse_body`); the header's size no longer grows with the trees. A manifest whose bodies are all
inline is written as version 1, so older readers still read replicated, DCP and fast-tier steps.

A manifest is read from storage that anyone with write access can change, so :func:`parse` checks every
field before anything is allocated or opened: types, known node kinds, nesting depth, counts, sizes, chunk
ranges inside their files, and names that are plain file names inside the step directory. Anything
inconsistent is a :class:`CheckpointCorruptError` (the caller falls back to an earlier step).

Example:
    >>> body = build(step=3, world_size=1, sharded=False, shards=[], metrics={})
    >>> parse(dumps(body), name="step_0000000003/manifest.json", step=3)["step"]
    3
"""

from __future__ import annotations

import math
import re
import sys
import time
from typing import Any

from vertexrt.checkpoint.datafiles import part_name
from vertexrt.checkpoint.serialization import CONTAINER_KINDS, LEAF_KINDS
from vertexrt.errors import CheckpointCorruptError, CheckpointError

FORMAT = "vertexrt.checkpoint"
FORMAT_VERSION = 2

MAX_MANIFEST_BYTES = 256 << 20
MAX_DEPTH = 200
MAX_SHARDS = 1 << 16
MAX_FILES = 1 << 16
MAX_FILE_BYTES = 1 << 46
MAX_DIMS = 64
_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,254}$")


def build(
    *, step: int, world_size: int, sharded: bool, shards: list[dict[str, Any]], metrics: dict[str, float]
) -> dict[str, Any]:
    """A manifest for ``step`` whose ``shards`` are ``{"shard", "prefix", "files", "tree"}`` bodies, or
    :func:`reference` s to body files (format version 2)."""
    return {
        "format": FORMAT,
        "format_version": 1 if all("tree" in body for body in shards) else FORMAT_VERSION,
        "vertexrt_version": _version(),
        "step": step,
        "time": time.time(),
        "metrics": metrics,
        "frameworks": _frameworks(),
        "world_size": world_size,
        "sharded": sharded,
        "shards": shards,
    }


def body_name(prefix: str) -> str:
    """The name of the body file of the shard whose data files start with ``prefix``."""
    return f"{prefix}.body.json"


def reference(body: dict[str, Any], data: bytes) -> dict[str, Any]:
    """A version 2 header's entry for ``body``, whose file holds ``data`` (``dumps(body)``)."""
    from vertexrt.checkpoint.datafiles import crc32c

    ref = {"name": body_name(body["prefix"]), "size": len(data), "crc32c": crc32c(data)}
    return {"shard": body["shard"], "prefix": body["prefix"], "files": body["files"], "body": ref}


def parse_body(data: bytes, *, name: str, entry: dict[str, Any], count: int) -> dict[str, Any]:
    """The validated body in ``data`` (read from ``name``) that the parsed header ``entry`` references;
    ``count``: the step's number of shards.

    Raises:
        CheckpointCorruptError: a size or CRC32C other than the header's, or any field out of schema.
    """
    import orjson

    from vertexrt.checkpoint.datafiles import crc32c

    ref = entry["body"]
    if len(data) != ref["size"] or crc32c(data) != ref["crc32c"]:
        raise _corrupt(name, f"is not the {ref['size']} bytes of CRC32C {ref['crc32c']} its step header says")
    try:
        body = orjson.loads(data)
    except orjson.JSONDecodeError as exc:
        raise _corrupt(name, f"is not valid JSON: {exc}") from None
    _check_body(name, "body", body, count)
    same = all(body[key] == entry[key] for key in ("shard", "prefix", "files"))
    _check(name, "body (shard, prefix, files)", "differ from its step header", same)
    return dict(body)


def dumps(value: Any) -> bytes:
    import orjson

    return bytes(orjson.dumps(value))


def parse(data: bytes, *, name: str, step: int | None = None) -> dict[str, Any]:
    """The validated manifest in ``data`` (read from ``name``).

    Raises:
        CheckpointCorruptError: not JSON, not a manifest, or any field out of schema or bounds.
        CheckpointError: a newer format version (upgrade vertexrt).
    """
    import orjson

    if len(data) > MAX_MANIFEST_BYTES:
        raise _corrupt(name, f"is {len(data)} bytes, more than the {MAX_MANIFEST_BYTES} a manifest may be")
    try:
        manifest = orjson.loads(data)  # orjson refuses nesting deeper than 1024 with a JSONDecodeError
    except orjson.JSONDecodeError as exc:
        raise CheckpointCorruptError(f"manifest {name} is not valid JSON: {exc}", file=name) from None
    if not isinstance(manifest, dict) or _get(manifest, "format") != FORMAT:
        raise CheckpointCorruptError(f"{name} is not a vertexrt checkpoint manifest", file=name)
    version = _get(manifest, "format_version")
    if not _int(version) or version < 1:
        raise _corrupt(name, f"has format_version {version!r}, not a positive integer")
    if version > FORMAT_VERSION:
        raise CheckpointError(
            f"{name} has checkpoint format version {version!r}, written by vertexrt "
            f"{_get(manifest, 'vertexrt_version')}; this vertexrt ({_version()}) reads up to version "
            f"{FORMAT_VERSION}: upgrade vertexrt to restore it"
        )
    _check(name, "step", _get(manifest, "step"), _int(_get(manifest, "step")) and manifest["step"] >= 0)
    if step is not None and manifest["step"] != step:
        raise _corrupt(name, f"says step {manifest['step']}, but it is the manifest of step {step}")
    when = _get(manifest, "time")
    _check(name, "time", when, isinstance(when, (int, float)) and not isinstance(when, bool))
    metrics = _get(manifest, "metrics")
    _check(name, "metrics", metrics, isinstance(metrics, dict))
    for key, value in metrics.items():
        _check(name, f"metrics[{key!r}]", value, value is None or _number(value))
    world = _get(manifest, "world_size")
    _check(name, "world_size", world, _int(world) and 1 <= world <= MAX_SHARDS)
    sharded = _get(manifest, "sharded")
    _check(name, "sharded", sharded, isinstance(sharded, bool))
    shards = _get(manifest, "shards")
    count = world if sharded else 1
    _check(name, "shards", "...", isinstance(shards, list) and len(shards) == count)
    seen: set[int] = set()
    for i, body in enumerate(shards):
        if version >= 2 and isinstance(body, dict) and "tree" not in body:
            _check_reference(name, f"shards[{i}]", body, count)
        else:
            _check_body(name, f"shards[{i}]", body, count)
        seen.add(body["shard"])
    _check(name, "shards[*].shard", sorted(seen), len(seen) == count)
    return manifest


def referenced(manifest: dict[str, Any]) -> set[str]:
    """The data (and body) file names a parsed manifest uses."""
    return set(referenced_sizes(manifest))


def referenced_sizes(manifest: dict[str, Any]) -> dict[str, int]:
    """Data (and body) file name -> size, over every shard of a parsed manifest."""
    sizes = {file: size for body in manifest["shards"] for file, size in body["files"].items()}
    sizes.update((b["body"]["name"], b["body"]["size"]) for b in manifest["shards"] if "body" in b)
    return sizes


def check_leaf(node: dict[str, Any], name: str) -> None:
    """The leaf's dtype and shape need exactly as many bytes as its chunks hold (before any allocation)."""
    kind = node["t"]
    nbytes = sum(chunk[2] for chunk in node["chunks"])
    if kind in ("bytes", "pickle"):
        return
    dtype, shape = _get(node, "dtype"), _get(node, "shape")
    if not isinstance(dtype, str) or not isinstance(shape, list) or len(shape) > MAX_DIMS:
        raise _corrupt(name, f"has a {kind} leaf with dtype {dtype!r} / shape {shape!r}")
    if not all(_int(d) and 0 <= d <= MAX_FILE_BYTES for d in shape):
        raise _corrupt(name, f"has a {kind} leaf with shape {shape!r}")
    itemsize = _itemsize(kind, dtype)
    if itemsize is None:
        raise _corrupt(name, f"has a {kind} leaf of unknown dtype {dtype[:40]!r} (or one of a newer {kind})")
    if math.prod(shape) * itemsize != nbytes:
        raise _corrupt(
            name, f"has a {kind} leaf of dtype {dtype} and shape {shape} in {nbytes} bytes: they disagree"
        )


def _check_reference(name: str, where: str, entry: dict[str, Any], count: int) -> None:
    _check_files(name, where, entry, count)
    ref = _get(entry, "body")
    _check(name, f"{where}.body", "...", isinstance(ref, dict))
    _check(name, f"{where}.body.name", _get(ref, "name"), _get(ref, "name") == body_name(entry["prefix"]))
    size, crc = _get(ref, "size"), _get(ref, "crc32c")
    _check(name, f"{where}.body.size", size, _int(size) and 0 < size <= MAX_MANIFEST_BYTES)
    _check(name, f"{where}.body.crc32c", crc, _int(crc) and 0 <= crc < 1 << 32)


def _check_body(name: str, where: str, body: Any, count: int) -> None:
    sizes = _check_files(name, where, body, count)
    _check(name, f"{where}.tree", "missing", "tree" in body)
    _check_tree(name, f"{where}.tree", body["tree"], sizes)


def _check_files(name: str, where: str, body: Any, count: int) -> list[int]:
    """The shard, prefix and files of a body or reference checked; the data files' sizes in order."""
    _check(name, where, "...", isinstance(body, dict))
    shard = _get(body, "shard")
    _check(name, f"{where}.shard", shard, _int(shard) and 0 <= shard < count)
    prefix = _get(body, "prefix")
    _check(name, f"{where}.prefix", prefix, isinstance(prefix, str) and bool(_NAME.match(prefix)))
    files = _get(body, "files")
    _check(name, f"{where}.files", "...", isinstance(files, dict) and len(files) <= MAX_FILES)
    for index, (file, size) in enumerate(sorted(files.items())):
        if file != part_name(prefix, index):
            raise _corrupt(name, f"lists data file {file!r} in {where}, not {part_name(prefix, index)!r}")
        _check(name, f"{where}.files[{file!r}]", size, _int(size) and 0 <= size <= MAX_FILE_BYTES)
    return [files[part_name(prefix, i)] for i in range(len(files))]


def _check_tree(name: str, where: str, tree: Any, sizes: list[int]) -> None:
    stack: list[tuple[Any, int]] = [(tree, 0)]
    while stack:
        node, depth = stack.pop()
        if depth > MAX_DEPTH:
            raise _corrupt(name, f"nests {where} deeper than {MAX_DEPTH} levels")
        if node is None or isinstance(node, (bool, str, int)) or (_number(node) and math.isfinite(node)):
            continue
        if not isinstance(node, dict):
            raise _corrupt(name, f"has a {type(node).__name__} node in {where}")
        kind = _get(node, "t")
        if not isinstance(kind, str):
            raise _corrupt(name, f"has a node kind {str(kind)[:40]} in {where}")
        if kind in ("int", "float"):
            _check(name, f"{where} {kind} node", _get(node, "v"), isinstance(_get(node, "v"), str))
            try:
                int(node["v"]) if kind == "int" else float(node["v"])
            except ValueError:
                raise _corrupt(name, f"has an {kind} node {node['v'][:40]!r} in {where}") from None
        elif kind in CONTAINER_KINDS:
            items = _get(node, "v")
            _check(name, f"{where} {kind} node", "...", isinstance(items, list))
            if kind == "dict":
                keys = _get(node, "k")
                ok = isinstance(keys, list) and len(keys) == len(items)
                _check(name, f"{where} dict keys", "...", ok and all(_key(k) for k in keys))
            stack.extend((item, depth + 1) for item in items)
        elif kind == "state":
            stack.append((_get(node, "v"), depth + 1))
        elif kind in LEAF_KINDS:
            _check_chunks(name, where, node, sizes)
        else:  # the format version says which kinds exist: an unknown one is damage
            raise _corrupt(name, f"has an unknown node kind {str(kind)[:40]!r} in {where}")


def _check_chunks(name: str, where: str, node: dict[str, Any], sizes: list[int]) -> None:
    chunks = _get(node, "chunks")
    _check(name, f"{where} leaf chunks", "...", isinstance(chunks, list))
    for chunk in chunks:
        ok = isinstance(chunk, list) and len(chunk) == 4 and all(_int(x) and x >= 0 for x in chunk)
        if not ok or chunk[0] >= len(sizes) or chunk[1] + chunk[2] > sizes[chunk[0]] or chunk[3] >= 1 << 32:
            raise _corrupt(name, f"has a chunk {str(chunk)[:80]} in {where} outside its data files")


def _itemsize(kind: str, dtype: str) -> int | None:
    try:
        if kind == "torch":
            import torch

            value = getattr(torch, dtype, None)
            return int(value.itemsize) if isinstance(value, torch.dtype) else None
        import numpy as np

        try:
            return int(np.dtype(dtype).itemsize)
        except TypeError:
            import ml_dtypes

            return int(np.dtype(getattr(ml_dtypes, dtype)).itemsize)
    except (TypeError, ValueError, AttributeError, ImportError):
        return None


def _check(name: str, field: str, value: Any, ok: Any) -> None:
    if not ok:
        raise _corrupt(name, f"has an invalid {field}: {str(value)[:80]}")


def _corrupt(name: str, what: str) -> CheckpointCorruptError:
    return CheckpointCorruptError(f"manifest {name} {what}", file=name)


def _get(mapping: dict[str, Any], key: str) -> Any:
    return mapping.get(key)


def _int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _key(key: Any) -> bool:
    return key is None or isinstance(key, (str, int, float, bool))


def _frameworks() -> dict[str, str]:
    found = {}
    for module_name in ("torch", "tensorflow", "keras", "numpy"):
        version = getattr(sys.modules.get(module_name), "__version__", None)
        if isinstance(version, str):
            found[module_name] = version
    return found


def _version() -> str:
    from vertexrt._version import __version__

    return __version__

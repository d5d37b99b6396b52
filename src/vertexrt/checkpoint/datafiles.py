"""Leaf bytes <-> a few large data files, written and read in parallel, with a CRC32C per chunk.

The leaves are laid end to end in one logical stream cut into parts of ``part_size`` bytes; part ``i`` is
file ``<prefix>.<i:05d>.bin``. A leaf crossing a part boundary becomes two chunks. Each leaf node gets
``"chunks": [[part, offset, length, crc32c], ...]``; the manifest lists the files with their sizes.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from vertexrt.checkpoint.storage import Store
from vertexrt.errors import CheckpointError


class CheckpointCorruptError(CheckpointError):
    """A committed checkpoint failed verification (checksum, size, missing file or unreadable manifest)."""

    def __init__(self, message: str, file: str | None = None) -> None:
        super().__init__(message)
        self.file = file


def crc32c(data: Any) -> int:
    """CRC32C of a contiguous buffer (numpy uint8 array, bytes), without copying writable buffers."""
    import google_crc32c

    if isinstance(data, bytes):
        return int(google_crc32c.value(data))
    if len(data) == 0:
        return 0
    try:
        view = (ctypes.c_char * len(data)).from_buffer(data)
    except TypeError:  # read-only buffer: google-crc32c only takes bytes or buffers without release hooks
        return int(google_crc32c.value(bytes(data)))
    return int(google_crc32c.value(view))


def part_name(prefix: str, index: int) -> str:
    return f"{prefix}.{index:05d}.bin"


def plan(sizes: Sequence[int], part_size: int) -> list[list[tuple[int, int, int, int]]]:
    """Per part, the ``(leaf, leaf_offset, part_offset, length)`` pieces that go into it, in order."""
    parts: list[list[tuple[int, int, int, int]]] = []
    cursor = 0
    for leaf, size in enumerate(sizes):
        done = 0
        while done < size:
            part, offset = divmod(cursor, part_size)
            length = min(size - done, part_size - offset)
            while len(parts) <= part:
                parts.append([])
            parts[part].append((leaf, done, offset, length))
            done += length
            cursor += length
    return parts


def write(
    store: Store,
    directory: str,
    prefix: str,
    nodes: Sequence[dict[str, Any]],
    buffers: Sequence[Any],
    *,
    part_size: int,
    threads: int,
) -> dict[str, int]:
    """Write ``buffers`` (1-D uint8 arrays) into part files; fill each node's ``chunks``; name -> size."""
    layout = plan([len(b) for b in buffers], part_size)
    for node in nodes:
        node["chunks"] = []

    def write_part(index: int) -> tuple[str, int, list[tuple[int, list[int]]]]:
        pieces = layout[index]
        views = [buffers[leaf][start : start + length] for leaf, start, _, length in pieces]
        chunks = [
            (leaf, [index, offset, length, crc32c(view)])
            for (leaf, _, offset, length), view in zip(pieces, views, strict=True)
        ]
        name = part_name(prefix, index)
        store.write_file(store.join(directory, name), views)
        return name, sum(len(v) for v in views), chunks

    files: dict[str, int] = {}
    for name, size, chunks in _run(write_part, range(len(layout)), threads):
        files[name] = size
        for leaf, chunk in chunks:
            nodes[leaf]["chunks"].append(chunk)
    for node in nodes:
        node["chunks"].sort()
    return files


def read(
    store: Store,
    directory: str,
    prefix: str,
    files: dict[str, int],
    nodes: Sequence[dict[str, Any]],
    buffers: Sequence[Any],
    *,
    threads: int,
) -> None:
    """Fill ``buffers`` from the part files and verify every chunk's CRC32C.

    Raises:
        CheckpointCorruptError: a missing or short file, or a checksum mismatch (names the file and range).
    """
    by_part: dict[int, list[tuple[int, int, Any, int]]] = {}
    for node, buffer in zip(nodes, buffers, strict=True):
        start = 0
        for part, offset, length, crc in node["chunks"]:
            by_part.setdefault(part, []).append((offset, length, buffer[start : start + length], crc))
            start += length
        if start != len(buffer):
            raise CheckpointCorruptError(
                f"a leaf's chunks cover {start} of {len(buffer)} bytes in {directory}"
            )

    def read_part(part: int) -> None:
        name = part_name(prefix, part)
        path = store.join(directory, name)
        expected = files.get(name)
        if expected is None:
            raise CheckpointCorruptError(f"{path} is not listed in the manifest", file=path)
        pieces = sorted(by_part[part], key=lambda p: p[0])
        try:
            store.read_ranges(path, [(offset, view) for offset, _, view, _ in pieces], expected)
        except FileNotFoundError:
            raise CheckpointCorruptError(f"data file {path} is missing", file=path) from None
        except EOFError as exc:
            raise CheckpointCorruptError(f"data file {path} is truncated: {exc}", file=path) from None
        for offset, length, view, crc in pieces:
            actual = crc32c(view)
            if actual != crc:
                raise CheckpointCorruptError(
                    f"checksum mismatch in data file {path} at bytes {offset}..{offset + length} "
                    f"(crc32c {actual:#010x}, manifest says {crc:#010x})",
                    file=path,
                )

    list(_run(read_part, sorted(by_part), threads))


def _run(fn: Any, items: Any, threads: int) -> list[Any]:
    items = list(items)
    if threads <= 1 or len(items) <= 1:
        return [fn(i) for i in items]
    with ThreadPoolExecutor(
        max_workers=min(threads, len(items)), thread_name_prefix="vertexrt-ckpt-io"
    ) as pool:
        return list(pool.map(fn, items))

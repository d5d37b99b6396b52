"""Leaf bytes <-> a few large data files, written and read in parallel, with a CRC32C per chunk.

The leaves are laid end to end (each 64-byte aligned) in one logical stream cut into parts of
``part_size`` bytes; part ``i`` is file ``<prefix>.<i:05d>.bin``. A leaf crossing a part boundary becomes
two chunks. Each leaf node gets ``"chunks": [[part, offset, length, crc32c], ...]``; the manifest lists
the files with their sizes.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from vertexrt.checkpoint.stores import Store
from vertexrt.errors import CheckpointCorruptError


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


ALIGN = 64


def part_name(prefix: str, index: int) -> str:
    return f"{prefix}.{index:05d}.bin"


def plan(sizes: Sequence[int], part_size: int) -> list[list[tuple[int, int, int, int]]]:
    """Per part, the ``(leaf, leaf_offset, part_offset, length)`` pieces that go into it, in order.

    Every leaf starts at a multiple of ``ALIGN`` bytes of the stream, so leaves can be used in place from
    a memory-mapped file; the gaps are zero bytes.
    """
    parts: list[list[tuple[int, int, int, int]]] = []
    cursor = 0
    for leaf, size in enumerate(sizes):
        cursor = -(-cursor // ALIGN) * ALIGN
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
    """Write ``buffers`` (1-D uint8 arrays) into part files; fill each node's ``chunks``; name -> size.

    When ``buffers`` has a ``ready(leaf)`` method (``staging.Staged``), it is called before a leaf's bytes
    are read, so leaf k is checksummed and written while leaf k+1 is still being copied off the GPU.
    """
    layout = plan([len(b) for b in buffers], part_size)
    ready = getattr(buffers, "ready", None)  # staging.Staged: a GPU leaf's copy may still be in flight
    for node in nodes:
        node["chunks"] = []

    def write_part(index: int) -> tuple[str, int, list[tuple[int, list[int]]]]:
        pieces = _Pieces(buffers, layout[index], index, ready)
        name = part_name(prefix, index)
        store.write_file(store.join(directory, name), pieces)
        return name, pieces.end, pieces.chunks()

    files: dict[str, int] = {}
    for name, size, chunks in _run(write_part, range(len(layout)), threads):
        files[name] = size
        for leaf, chunk in chunks:
            nodes[leaf]["chunks"].append(chunk)
    for node in nodes:
        node["chunks"].sort()
    return files


class _Pieces(Sequence[Any]):
    """A part's byte views in file order (zero gaps included), each made ready and checksummed on access.

    Reading them in order (as ``Store.write_file`` does) interleaves wait, CRC and write per leaf.
    """

    def __init__(
        self, buffers: Sequence[Any], layout: list[tuple[int, int, int, int]], part: int, ready: Any
    ) -> None:
        import numpy as np

        self._views: list[tuple[int | None, Any, int, int]] = []  # leaf (None: gap), view/bytes, offset
        end = 0
        for leaf, start, offset, length in layout:
            if offset > end:
                self._views.append((None, np.zeros(offset - end, dtype=np.uint8), end, offset - end))
            self._views.append((leaf, (start, length), offset, length))
            end = offset + length
        self.end = end
        self._buffers, self._part, self._ready = buffers, part, ready
        self._crcs: dict[int, int] = {}

    def __len__(self) -> int:
        return len(self._views)

    def __getitem__(self, i: Any) -> Any:
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        leaf, view, _, _ = self._views[i]
        if leaf is None:
            return view
        if self._ready is not None:
            self._ready(leaf)
        start, length = view
        data = self._buffers[leaf][start : start + length]
        if i not in self._crcs:
            self._crcs[i] = crc32c(data)
        return data

    def chunks(self) -> list[tuple[int, list[int]]]:
        out = []
        for i, (leaf, _, offset, length) in enumerate(self._views):
            if leaf is not None:
                if i not in self._crcs:
                    self[i]
                out.append((leaf, [self._part, offset, length, self._crcs[i]]))
        return out


def read(
    store: Store,
    directory: str,
    prefix: str,
    files: dict[str, int],
    nodes: Sequence[dict[str, Any]],
    *,
    threads: int,
    use_mmap: bool = False,
) -> list[Any]:
    """Each leaf's bytes (1-D uint8 arrays), every chunk's CRC32C verified.

    With ``use_mmap`` (local disk), the part files are mapped copy-on-write and leaves that sit in one
    part are returned as views of the mapping: no copy, and pages are only read once, by the checksum.

    Raises:
        CheckpointCorruptError: a missing or short file, or a checksum mismatch (names the file and range).
    """
    import numpy as np

    sizes = [sum(chunk[2] for chunk in node.get("chunks", [])) for node in nodes]
    mapped: dict[int, Any] = {}
    if use_mmap:
        parts = sorted({chunk[0] for node in nodes for chunk in node.get("chunks", [])})
        for part, array in zip(
            parts,
            _run(lambda p: _open_part(store, directory, prefix, files, p, True), parts, threads),
            strict=True,
        ):
            mapped[part] = array
    buffers: list[Any] = []
    by_part: dict[int, list[tuple[int, int, Any, int, bool]]] = {}  # offset, length, view, crc, in place
    for node, size in zip(nodes, sizes, strict=True):
        chunks = node.get("chunks", [])
        if len(chunks) == 1 and chunks[0][0] in mapped:
            part, offset, length, crc = chunks[0]
            buffer = mapped[part][offset : offset + length]
            by_part.setdefault(part, []).append((offset, length, buffer, crc, True))
            buffers.append(buffer)
            continue
        buffer = np.empty(size, dtype=np.uint8)
        start = 0
        for part, offset, length, crc in chunks:
            by_part.setdefault(part, []).append((offset, length, buffer[start : start + length], crc, False))
            start += length
        buffers.append(buffer)

    def read_part(part: int) -> None:
        pieces = sorted(by_part[part], key=lambda p: p[0])
        path = store.join(directory, part_name(prefix, part))
        if part in mapped:
            for offset, length, view, _, in_place in pieces:
                if not in_place:
                    view[:] = mapped[part][offset : offset + length]
        else:
            _open_part(store, directory, prefix, files, part, False, [(p[0], p[2]) for p in pieces])
        for offset, length, view, crc, _ in pieces:
            actual = crc32c(view)
            if actual != crc:
                raise CheckpointCorruptError(
                    f"checksum mismatch in data file {path} at bytes {offset}..{offset + length} "
                    f"(crc32c {actual:#010x}, manifest says {crc:#010x})",
                    file=path,
                )

    _run(read_part, sorted(by_part), threads)
    return buffers


def _open_part(
    store: Store,
    directory: str,
    prefix: str,
    files: dict[str, int],
    part: int,
    use_mmap: bool,
    ranges: Sequence[tuple[int, Any]] = (),
) -> Any:
    name = part_name(prefix, part)
    path = store.join(directory, name)
    expected = files.get(name)
    if expected is None:
        raise CheckpointCorruptError(f"{path} is not listed in the manifest", file=path)
    try:
        if use_mmap:
            return store.map(path, expected)
        store.read_ranges(path, ranges, expected)
        return None
    except FileNotFoundError:
        raise CheckpointCorruptError(f"data file {path} is missing", file=path) from None
    except EOFError as exc:
        raise CheckpointCorruptError(f"data file {path} is truncated: {exc}", file=path) from None


def _run(fn: Any, items: Any, threads: int) -> list[Any]:
    items = list(items)
    if threads <= 1 or len(items) <= 1:
        return [fn(i) for i in items]
    with ThreadPoolExecutor(
        max_workers=min(threads, len(items)), thread_name_prefix="vertexrt-ckpt-io"
    ) as pool:
        return list(pool.map(fn, items))

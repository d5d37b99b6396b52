"""Host staging for checkpoints: leaves copied off the GPU (and out of live CPU memory) without stalling.

A save stages its leaves into one reused host arena (pinned when any leaf is on a GPU, grown when the state
grows). GPU leaves are copied with non-blocking copies on a side stream that first waits for the caller's
stream; the caller's stream then waits for the copies before its next kernel, so the training step can
mutate its tensors right after ``save()`` returns without the host ever waiting for the GPU. The writer
calls :meth:`Staged.ready` on a leaf before it reads it, so a synchronous save checksums and writes leaf k
while leaf k+1 is still being copied. Live CPU leaves (async saves) are copied in parallel chunks.

A restore to the GPU goes through :class:`Uploader`: a few pinned bounce buffers filled by host threads,
each emptied by a non-blocking host-to-device copy on the current stream.

Example:
    >>> stager = Stager()
    >>> buffers = stager.stage(encoded_leaves, copy_host=True)   # returns once the copies are enqueued
    >>> buffers.ready(0); write(buffers[0])                       # on the writer thread
"""

from __future__ import annotations

import contextvars
import logging
import os
import threading
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any

log = logging.getLogger(__name__)

#: Bytes per task of the parallel host copy and per bounce buffer of an upload.
CHUNK = 32 << 20
#: Leaf offsets in the arena are multiples of this (fast DMA, cache-line aligned views).
ALIGN = 4096
#: The arena grows in steps of at least this fraction of its size (few re-allocations as state grows).
GROWTH = 0.25


def copy_threads() -> int:
    return max(1, min(16, os.cpu_count() or 1))


class Staged(list):  # type: ignore[type-arg]
    """The leaves' host buffers (1-D uint8 arrays); :meth:`ready` before reading a GPU leaf's bytes."""

    def __init__(self, buffers: Sequence[Any], events: dict[int, Any]) -> None:
        super().__init__(buffers)
        self.events = events

    def ready(self, leaf: int) -> None:
        """Block until leaf ``leaf``'s device-to-host copy has landed (no-op for host leaves)."""
        event = self.events.get(leaf)
        if event is not None:
            event.synchronize()


class Arena:
    """One reused host buffer, pinned when asked and possible; pageable (with a warning) otherwise."""

    def __init__(self) -> None:
        self.array: Any = None  # numpy uint8 view of the buffer
        self.tensor: Any = None  # the torch tensor owning it, when allocated through torch
        self.pinned = False

    def __len__(self) -> int:
        return 0 if self.array is None else len(self.array)

    def reserve(self, nbytes: int, *, pinned: bool) -> Any:
        """The buffer, at least ``nbytes`` long; re-allocated when too small (or not pinned, if asked)."""
        if self.array is not None and len(self.array) >= nbytes and (self.pinned or not pinned):
            return self.array
        size = max(nbytes, len(self) + int(len(self) * GROWTH)) if self.array is not None else nbytes
        self.array = self.tensor = None  # free the old buffer before allocating the new one
        self.array, self.tensor, self.pinned = _allocate(size, pinned)
        return self.array


def _allocate(nbytes: int, pinned: bool) -> tuple[Any, Any, bool]:
    import numpy as np

    if pinned:
        import torch

        try:
            tensor = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
            return tensor.numpy(), tensor, True
        except RuntimeError as exc:
            log.warning(
                "could not pin %d bytes of host memory for checkpoint staging (%s); using pageable memory: "
                "saves of GPU state block longer. Free host memory or save less state per step",
                nbytes,
                exc,
            )
    return np.empty(nbytes, dtype=np.uint8), None, False


class Stager:
    """Stages encoded leaves (``adapters.Encoded``) into a reused host arena; see the module docstring."""

    def __init__(self, threads: int | None = None) -> None:
        self.arena = Arena()
        self.threads = threads or copy_threads()
        self._pool: ThreadPoolExecutor | None = None
        self._streams: dict[Any, Any] = {}

    def close(self) -> None:
        """Stop the copy threads and free the arena (a later ``stage`` starts them again)."""
        pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)
        self.arena = Arena()

    def stage(self, encoded: Sequence[Any], *, copy_host: bool) -> Staged:
        """Host buffers for ``encoded``: GPU leaves always copied, live CPU leaves when ``copy_host``."""
        import numpy as np

        copied = [e.data is None or (copy_host and not e.owned) for e in encoded]
        offsets, end = [], 0
        for e, copy in zip(encoded, copied, strict=True):
            offsets.append(end)
            if copy:
                end += -(-e.nbytes // ALIGN) * ALIGN
        on_device = any(e.data is None for e in encoded)
        arena = self.arena.reserve(end, pinned=on_device) if end else np.empty(0, dtype=np.uint8)
        buffers: list[Any] = []
        host_jobs: list[tuple[Any, Any]] = []
        device_jobs: list[tuple[int, Any, Any]] = []
        for leaf, (e, copy, start) in enumerate(zip(encoded, copied, offsets, strict=True)):
            if not copy:
                buffers.append(e.data)
                continue
            view = arena[start : start + e.nbytes]
            buffers.append(view)
            if e.data is None:
                device_jobs.append((leaf, e.device, start))
            else:
                host_jobs.append((view, e.data))
        events = self._copy_from_devices(device_jobs) if device_jobs else {}
        if host_jobs:
            self._copy_host(host_jobs)
        return Staged(buffers, events)

    def _copy_from_devices(self, jobs: list[tuple[int, Any, int]]) -> dict[int, Any]:
        import torch

        host = self.arena.tensor if self.arena.tensor is not None else torch.from_numpy(self.arena.array)
        events: dict[int, Any] = {}
        by_device: dict[Any, list[tuple[int, Any, int]]] = {}
        for job in jobs:
            by_device.setdefault(job[1].device, []).append(job)
        for device, group in by_device.items():
            if device.type != "cuda":  # other accelerators: a plain blocking copy
                for _, source, start in group:
                    host[start : start + source.numel()].copy_(source)
                continue
            current = torch.cuda.current_stream(device)
            side = self._streams.get(device)
            if side is None:
                side = self._streams[device] = torch.cuda.Stream(device)
            side.wait_stream(current)  # copy what the step computed, not what it is computing
            with torch.cuda.stream(side):
                for leaf, source, start in group:
                    host[start : start + source.numel()].copy_(source, non_blocking=True)
                    source.record_stream(side)  # its memory is not reused before the copy ran
                    event = torch.cuda.Event()
                    event.record(side)
                    events[leaf] = event
            current.wait_event(event)  # the next kernel that could mutate a leaf runs after the copies
        return events

    def _copy_host(self, jobs: list[tuple[Any, Any]]) -> None:
        import numpy as np

        tasks: list[list[tuple[Any, Any]]] = [[]]
        size = 0
        for dst, src in jobs:
            for start in range(0, len(src), CHUNK):
                if size >= CHUNK:
                    tasks.append([])
                    size = 0
                piece = slice(start, start + CHUNK)
                tasks[-1].append((dst[piece], src[piece]))
                size += min(CHUNK, len(src) - start)

        def run(task: list[tuple[Any, Any]]) -> None:
            for dst, src in task:
                np.copyto(dst, src)  # releases the GIL: the copies run in parallel

        if self.threads <= 1 or len(tasks) <= 1:
            for task in tasks:
                run(task)
            return
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="vertexrt-ckpt-copy")
        list(self._pool.map(run, tasks))


# -- restore: host bytes to the device ---------------------------------------------------------------------

_UPLOADER: contextvars.ContextVar[Uploader | None] = contextvars.ContextVar("vertexrt_uploader", default=None)


class Uploader:
    """Host bytes -> GPU tensors through ``slots`` reused pinned bounce buffers, non-blocking copies."""

    def __init__(self, slots: int = 4, chunk: int = CHUNK) -> None:
        self.chunk = chunk
        self._slots: list[tuple[Any, Any, threading.Lock, list[Any]]] = []
        self._count = slots
        self._next = 0
        self._pool: ThreadPoolExecutor | None = None
        self._pending: list[Any] = []

    def copy(self, source: Any, target: Any) -> None:
        """Enqueue ``target`` (contiguous GPU tensor) <- ``source`` (1-D uint8 host array of its bytes)."""
        import torch

        if not self._slots:
            for _ in range(self._count):
                host, tensor, _pinned = _allocate(self.chunk, True)
                self._slots.append(
                    (host, tensor if tensor is not None else torch.from_numpy(host), threading.Lock(), [None])
                )
            self._pool = ThreadPoolExecutor(self._count, thread_name_prefix="vertexrt-ckpt-upload")
        dest = target.detach().view(-1).view(torch.uint8)
        stream = torch.cuda.current_stream(target.device)
        assert self._pool is not None
        for start in range(0, len(source), self.chunk):
            slot = self._slots[self._next % self._count]
            self._next += 1
            piece = slice(start, start + self.chunk)
            self._pending.append(self._pool.submit(self._upload, slot, source[piece], dest[piece], stream))

    @staticmethod
    def _upload(slot: tuple[Any, Any, threading.Lock, list[Any]], src: Any, dst: Any, stream: Any) -> None:
        import numpy as np
        import torch

        host, bounce, lock, last = slot
        with lock:
            if last[0] is not None:
                last[0].synchronize()  # the slot's previous copy has left it
            n = len(src)
            np.copyto(host[:n], src)
            with torch.cuda.stream(stream):
                dst.copy_(bounce[:n], non_blocking=True)
                event = torch.cuda.Event()
                event.record(stream)
            last[0] = event

    def finish(self) -> None:
        """Wait for every enqueued copy to leave the bounce buffers; re-raise a failed one."""
        pending, self._pending = self._pending, []
        for future in pending:
            future.result()
        for _, _, lock, last in self._slots:
            with lock:
                if last[0] is not None:
                    last[0].synchronize()
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        self._slots = []


@contextmanager
def uploads() -> Iterator[None]:
    """Within it, :func:`copy_to_device` batches its copies in one :class:`Uploader` (finished on exit)."""
    uploader = Uploader()
    token = _UPLOADER.set(uploader)
    try:
        yield
    finally:
        _UPLOADER.reset(token)
        uploader.finish()


def copy_to_device(source: Any, target: Any) -> bool:
    """Copy CPU tensor ``source`` into CUDA tensor ``target`` through pinned buffers; False if not applicable.

    Applies when ``target`` is a contiguous CUDA tensor of ``source``'s dtype and shape.
    """
    import torch

    if not (
        target.device.type == "cuda"
        and source.device.type == "cpu"
        and target.is_contiguous()
        and target.dtype == source.dtype
        and target.shape == source.shape
        and source.numel() > 0
    ):
        return False
    host = source.detach().contiguous().view(-1).view(torch.uint8).numpy()
    uploader = _UPLOADER.get()
    if uploader is not None:
        uploader.copy(host, target)
        return True
    one = Uploader(slots=2)
    try:
        one.copy(host, target)
    finally:
        one.finish()
    return True

"""Host staging for checkpoints: leaves copied off the GPU (and out of live CPU memory) without stalling.

A save stages its leaves into one reused host arena. When any leaf is on a GPU the arena is one block of
host memory registered with CUDA (page-locked) of exactly the state's size, never rounded up to a power of
two as torch's pinned allocator does, capped by ``VERTEXRT_PINNED_LIMIT`` (bytes; default a quarter of the
host's memory shared by its local processes) and released by :meth:`Stager.close`. The block is pinned on a
background thread: the first save (and a save whose state outgrew the block) uses pageable memory while it
is being pinned, so no save waits seconds for the kernel to lock pages.

GPU leaves are copied with non-blocking copies on a side stream that first waits for the caller's stream.
The caller's stream waits for those copies before its next kernel, except for the parameters and state of
an optimizer saved in the same state: their copies overlap the next forward and backward passes, and the
next ``step()`` of any torch optimizer waits for them on its stream (a global optimizer step pre-hook).
The host never waits for the GPU. The writer calls :meth:`Staged.ready` on a leaf before it reads it, so a
synchronous save checksums and writes leaf k while leaf k+1 is still being copied.

Live CPU leaves (async saves) follow the same contract on the host: the parameters and state of a saved
optimizer are copied into the arena by the copy threads in the background (in parallel chunks) while
``stage()`` returns; the other leaves (buffers, plain tensors, numpy arrays) are copied before it returns.
The next ``step()`` of any torch optimizer waits for the background copies, and so do the next
``stage()``, :meth:`Stager.wait` and :meth:`Stager.close`; :meth:`Staged.ready` waits for one leaf's.

Code that changes a parameter or optimizer state tensor in place before the next ``optimizer.step()`` must
call the manager's ``wait()`` first (it returns once the writer has read every leaf, each after its copy).
A background copy that fails fails its save (``ready`` raises :class:`~vertexrt.errors.CheckpointError`)
and is raised once more, as a ``CheckpointError``, by the first of the next optimizer step, ``stage()``,
``wait()`` or ``close()`` that waits for it: never lost.

The other direction, a restore's host bytes to the GPU, is ``vertexrt.checkpoint.uploads``.

Example:
    >>> stager = Stager()
    >>> buffers = stager.stage(encoded_leaves, copy_host=True)   # returns once the copies are enqueued
    >>> buffers.ready(0); write(buffers[0])                       # on the writer thread
    >>> optimizer.step()                                          # waits for the deferred copies first
"""

from __future__ import annotations

import logging
import mmap
import os
import re
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from typing import Any

from vertexrt.errors import CheckpointError, ConfigError

log = logging.getLogger(__name__)

#: Bytes per task of the parallel host copy and per bounce buffer of an upload.
CHUNK = 32 << 20
#: Leaf offsets in the arena are multiples of this (fast DMA, cache-line aligned views).
ALIGN = 4096
#: A pageable arena grows in steps of at least this fraction of its size (few re-allocations as state grows).
GROWTH = 0.25
#: The environment variable capping the pinned host memory of one process's checkpoint staging.
PINNED_LIMIT_VAR = "VERTEXRT_PINNED_LIMIT"
#: Without ``VERTEXRT_PINNED_LIMIT``: this fraction of the host's memory, shared by its local processes.
PINNED_FRACTION = 0.25
#: What a failed background host copy's error suggests.
COPY_FAILURE_HINT = "Check the host's free memory; if it has room, report this message as a vertexrt bug"
_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def copy_threads() -> int:
    return max(1, min(16, os.cpu_count() or 1))


def page_rounded(nbytes: int) -> int:
    """``nbytes`` rounded up to whole pages: the host memory a pinned block of ``nbytes`` holds."""
    page = mmap.PAGESIZE
    return -(-nbytes // page) * page


def pinned_limit() -> int:
    """The most host memory (bytes) one process pins for checkpoint staging: ``VERTEXRT_PINNED_LIMIT``
    (an integer, optionally with a K/M/G/T or KiB/MiB/GiB/TiB suffix, all powers of 1024; 0 = never pin),
    else :data:`PINNED_FRACTION` of the host's memory divided by its local processes.

    Raises:
        ConfigError: ``VERTEXRT_PINNED_LIMIT`` is not a byte count.
    """
    raw = os.environ.get(PINNED_LIMIT_VAR, "").strip()
    if raw:
        match = re.fullmatch(r"(\d+)\s*([kmgt]?)(?:i?b)?", raw.lower())
        if match is None:
            raise ConfigError(
                f"{PINNED_LIMIT_VAR}={raw!r} is not a byte count; use e.g. 34359738368, 32GiB or 0 "
                "(never pin)"
            )
        return int(match.group(1)) * _UNITS[match.group(2)]
    return int(host_memory() * PINNED_FRACTION) // _local_processes()


def host_memory() -> int:
    """This machine's memory in bytes, or the container's memory limit (cgroup v2 / v1) when lower."""
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            with open(path) as f:
                text = f.read().strip()
        except OSError:
            continue
        if text.isdigit():
            total = min(total, int(text))
    return total


def _local_processes() -> int:
    from vertexrt.distributed import world_info
    from vertexrt.errors import ClusterSpecError

    try:
        return max(1, world_info().local_world_size)
    except ClusterSpecError:
        return 1


class Staged(list):  # type: ignore[type-arg]
    """The leaves' host buffers (1-D uint8 arrays); :meth:`ready` before reading a leaf's bytes.

    ``events``: leaf -> the event of its device-to-host copy; ``copies``: leaf -> the futures of its
    background host copy (the chunks that hold its bytes).
    """

    def __init__(
        self,
        buffers: Sequence[Any],
        events: dict[int, Any],
        copies: dict[int, list[Future[None]]] | None = None,
    ) -> None:
        super().__init__(buffers)
        self.events = events
        self.copies = copies or {}

    def ready(self, leaf: int) -> None:
        """Block until leaf ``leaf``'s copy has landed (no-op for a leaf read from live memory).

        Raises:
            CheckpointError: its background host copy failed (the save must not write it).
        """
        event = self.events.get(leaf)
        if event is not None:
            event.synchronize()
        for future in self.copies.get(leaf, ()):
            error = future.exception()
            if error is not None:
                raise CheckpointError(
                    f"the background copy of checkpoint leaf {leaf} ({len(self[leaf])} bytes) into host "
                    f"memory failed: {error!r}; this save fails. {COPY_FAILURE_HINT}"
                ) from error


class CudaHostRegistry:
    """Page-locks host memory for CUDA (``cudaHostRegister``) and unlocks it; the arena's only device call."""

    def register(self, address: int, nbytes: int) -> None:
        import torch

        code = int(torch.cuda.cudart().cudaHostRegister(address, nbytes, 0))
        if code != 0:
            raise RuntimeError(f"cudaHostRegister failed with CUDA error {code}")

    def unregister(self, address: int) -> None:
        import torch

        code = int(torch.cuda.cudart().cudaHostUnregister(address))
        if code != 0:
            log.warning("cudaHostUnregister failed with CUDA error %d: the pages stay locked", code)


class PinnedBlock:
    """``nbytes`` of anonymous host memory, page-locked through ``registry`` (raises when that fails)."""

    def __init__(self, nbytes: int, registry: Any) -> None:
        import numpy as np

        self.nbytes = nbytes
        self.registry = registry
        self._map: mmap.mmap | None = mmap.mmap(-1, page_rounded(max(1, nbytes)))
        self.array: Any = np.frombuffer(self._map, dtype=np.uint8, count=nbytes)
        self.address = int(self.array.ctypes.data)
        try:
            registry.register(self.address, len(self._map))
        except BaseException:
            self.array = None
            self._map.close()
            raise
        self.registered = True

    def release(self) -> None:
        """Unlock the pages and return them (views still alive keep the mapping, no longer locked)."""
        if self.registered:
            self.registered = False
            self.registry.unregister(self.address)
        self.array = None
        mapping, self._map = self._map, None
        if mapping is not None:
            try:
                mapping.close()
            except BufferError:  # a staged view outlives the block: the mapping goes with the last view
                pass


class Arena:
    """One reused host buffer: pinned (a :class:`PinnedBlock` of the state's size) when asked and allowed.

    ``reserve(n, pinned=True)`` returns the pinned block when one of at least ``n`` bytes is ready; else it
    starts pinning a block of exactly ``n`` bytes on a background thread (when ``n`` is within
    :func:`pinned_limit`) and returns pageable memory for this save.
    """

    def __init__(self, registry: Any = None, limit: Callable[[], int] = pinned_limit) -> None:
        self.registry = registry if registry is not None else CudaHostRegistry()
        self.limit = limit
        self.array: Any = None  # numpy uint8 view of the buffer the last reserve returned
        self.pinned = False
        self._pageable: Any = None
        self._block: PinnedBlock | None = None
        self._pinning: tuple[int, threading.Thread, list[Any]] | None = None  # (size, thread, [block|error])
        self._warned: set[str] = set()

    def __len__(self) -> int:
        return 0 if self.array is None else len(self.array)

    @property
    def pinned_bytes(self) -> int:
        """Host bytes this arena holds page-locked now (whole pages)."""
        blocks = [self._block] + ([self._pinning[2][0]] if self._pinning and self._pinning[2] else [])
        return sum(page_rounded(b.nbytes) for b in blocks if isinstance(b, PinnedBlock) and b.registered)

    def reserve(self, nbytes: int, *, pinned: bool) -> Any:
        """A buffer of at least ``nbytes`` (see the class docstring)."""
        if pinned:
            self._adopt_pinned()
            block = self._block
            if block is not None and block.nbytes >= nbytes:
                self._pageable = None  # the pinned block serves from now on
                self.array, self.pinned = block.array, True
                return self.array
            self._start_pinning(nbytes)
        self.array, self.pinned = self._pageable_buffer(nbytes), False
        return self.array

    def settle(self) -> None:
        """Wait for a block being pinned in the background, and use it from the next ``reserve`` on."""
        pinning = self._pinning
        if pinning is not None:
            pinning[1].join()
        self._adopt_pinned()

    def release(self) -> None:
        """Free every buffer: the pinned block is unlocked and returned to the system."""
        pinning, self._pinning = self._pinning, None
        if pinning is not None:
            pinning[1].join()
            if pinning[2] and isinstance(pinning[2][0], PinnedBlock):
                pinning[2][0].release()
        block, self._block = self._block, None
        if block is not None:
            block.release()
        self.array = self._pageable = None
        self.pinned = False

    def _pageable_buffer(self, nbytes: int) -> Any:
        import numpy as np

        current = self._pageable
        if current is not None and len(current) >= nbytes:
            return current
        size = max(nbytes, len(current) + int(len(current) * GROWTH)) if current is not None else nbytes
        self._pageable = None  # free the old buffer before allocating the new one
        self._pageable = np.empty(size, dtype=np.uint8)
        return self._pageable

    def _start_pinning(self, nbytes: int) -> None:
        if self._pinning is not None or "failed" in self._warned:
            return  # one block at a time (a grown state gets its block once this one landed); no retry
        limit = self.limit()
        if page_rounded(nbytes) > limit:
            self._warn_once(
                "limit",
                "checkpoint staging needs %d bytes of host memory but %s allows pinning %d: GPU state is "
                "staged in pageable memory, so saves block longer. Raise %s (bytes) if the host has the "
                "memory, or save less state per step",
                nbytes,
                PINNED_LIMIT_VAR,
                limit,
                PINNED_LIMIT_VAR,
            )
            return
        if self._block is not None:  # too small for the state now: unlocked before a bigger one is locked
            self._block.release()
            self._block = None
        box: list[Any] = []

        def pin() -> None:
            try:
                box.append(PinnedBlock(nbytes, self.registry))
            except Exception as exc:  # no CUDA runtime, RLIMIT_MEMLOCK, ...
                box.append(exc)

        thread = threading.Thread(target=pin, name="vertexrt-ckpt-pin", daemon=True)
        self._pinning = (nbytes, thread, box)
        thread.start()

    def _adopt_pinned(self) -> None:
        pinning = self._pinning
        if pinning is None or pinning[1].is_alive():
            return
        self._pinning = None
        result = pinning[2][0] if pinning[2] else None
        if isinstance(result, PinnedBlock):
            self._block = result
        elif result is not None:
            self._warn_once(
                "failed",
                "could not pin %d bytes of host memory for checkpoint staging (%s); using pageable memory: "
                "saves of GPU state block longer. Free host memory or lower %s",
                pinning[0],
                result,
                PINNED_LIMIT_VAR,
            )

    def _warn_once(self, kind: str, message: str, *args: Any) -> None:
        if kind not in self._warned:
            self._warned.add(kind)
            log.warning(message, *args)


class Stager:
    """Stages encoded leaves (``adapters.Encoded``) into a reused host arena; see the module docstring.

    ``pool`` runs the host copies (default: :attr:`threads` threads, started on first use and stopped by
    :meth:`close`; a pool passed in stays the caller's to shut down).
    """

    def __init__(
        self, threads: int | None = None, arena: Arena | None = None, pool: Executor | None = None
    ) -> None:
        self.arena = arena if arena is not None else Arena()
        self.threads = threads or copy_threads()
        self._pool = pool
        self._owns_pool = pool is None
        self._streams: dict[Any, Any] = {}
        self._before_step = OptimizerStepBarrier()
        self._in_flight: list[Any] = []  # the last stage()'s copy events

    def close(self) -> None:
        """Wait for the copies, stop the copy threads and free the arena, unlocking its pinned memory
        (``stage`` starts again). Raises a background copy's failure that nothing raised yet."""
        try:
            self.wait()
        finally:
            if self._owns_pool and self._pool is not None:
                self._pool.shutdown(wait=True)
                self._pool = None
            self.arena.release()

    def wait(self) -> None:
        """Wait for the last :meth:`stage`'s copies (device copies: ordered before what the current streams
        run next; host copies: landed) and remove the optimizer step hook.

        Raises:
            CheckpointError: a background host copy failed (raised once: here, or where it was waited for
                first).
        """
        try:
            self._before_step.release()
        finally:
            self._drain()

    def stage(self, encoded: Sequence[Any], *, copy_host: bool) -> Staged:
        """Host buffers for ``encoded``: GPU leaves always copied, live CPU leaves when ``copy_host``.

        Returns once the device copies are queued and the host copies of leaves no optimizer owns have
        landed (the others land in the background: :meth:`Staged.ready`). The previous call's buffers must
        no longer be in use (the manager waits for the save in flight); its copies are waited for first.
        """
        import numpy as np

        self.wait()  # the previous save's deferred copies: ordered before this save's
        copied = [e.data is None or (copy_host and not e.owned) for e in encoded]
        offsets, end = [], 0
        for e, copy in zip(encoded, copied, strict=True):
            offsets.append(end)
            if copy:
                end += -(-e.nbytes // ALIGN) * ALIGN
        on_device = any(e.data is None for e in encoded)
        arena = self.arena.reserve(end, pinned=on_device) if end else np.empty(0, dtype=np.uint8)
        buffers: list[Any] = []
        urgent: list[tuple[int, Any, Any]] = []
        deferred: list[tuple[int, Any, Any]] = []
        device_jobs: list[tuple[int, Any, int, bool]] = []
        for leaf, (e, copy, start) in enumerate(zip(encoded, copied, offsets, strict=True)):
            if not copy:
                buffers.append(e.data)
                continue
            view = arena[start : start + e.nbytes]
            buffers.append(view)
            if e.data is None:
                device_jobs.append((leaf, e.device, start, e.optimizer_owned))
            else:
                (deferred if e.optimizer_owned else urgent).append((leaf, view, e.data))
        events = self._copy_from_devices(device_jobs, arena) if device_jobs else {}
        self._in_flight = list(events.values())
        if urgent:
            self._copy_host(urgent)
        copies = self._copy_host_later(deferred) if deferred else {}
        return Staged(buffers, events, copies)

    def _drain(self) -> None:
        """Wait for the last copies into the arena (a save that failed midway left some unread)."""
        events, self._in_flight = self._in_flight, []
        for event in events:
            event.synchronize()

    def _copy_from_devices(self, jobs: list[tuple[int, Any, int, bool]], arena: Any) -> dict[int, Any]:
        import torch

        host = torch.from_numpy(arena)
        events: dict[int, Any] = {}
        by_device: dict[Any, list[tuple[int, Any, int, bool]]] = {}
        for job in jobs:
            by_device.setdefault(job[1].device, []).append(job)
        for device, group in by_device.items():
            if device.type != "cuda":  # other accelerators: a plain blocking copy
                for _, source, start, _ in group:
                    host[start : start + source.numel()].copy_(source)
                continue
            current = torch.cuda.current_stream(device)
            side = self._streams.get(device)
            if side is None:
                side = self._streams[device] = torch.cuda.Stream(device)
            side.wait_stream(current)  # copy what the step computed, not what it is computing
            urgent, deferred = copy_order(group)
            with torch.cuda.stream(side):
                for leaf, source, start, _ in urgent + deferred:
                    host[start : start + source.numel()].copy_(source, non_blocking=True)
                    source.record_stream(side)  # its memory is not reused before the copy ran
                    event = torch.cuda.Event()
                    event.record(side)
                    events[leaf] = event
                    if urgent and leaf == urgent[-1][0]:
                        # the next kernel that could change a leaf other code may mutate runs after these
                        current.wait_event(event)
            if deferred:  # parameters and optimizer state: the next optimizer step waits for their copies
                self._before_step.add(device, events[deferred[-1][0]])
        return events

    def _copy_host(self, jobs: list[tuple[int, Any, Any]]) -> None:
        """Copy now, in parallel chunks on the pool."""
        tasks = [pieces for _, pieces in chunked(jobs)]
        if self.threads <= 1 or len(tasks) <= 1:
            for task in tasks:
                copy_pieces(task)
            return
        list(self._executor().map(copy_pieces, tasks))

    def _copy_host_later(self, jobs: list[tuple[int, Any, Any]]) -> dict[int, list[Future[None]]]:
        """Start the copies on the pool; the next optimizer step (or stage, wait, close) waits for them."""
        pool = self._executor()
        copies: dict[int, list[Future[None]]] = {}
        for leaves, pieces in chunked(jobs):
            future = pool.submit(copy_pieces, pieces)
            for leaf in leaves:
                copies.setdefault(leaf, []).append(future)
            self._before_step.add_copy(future, leaves)
        return copies

    def _executor(self) -> Executor:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="vertexrt-ckpt-copy")
        return self._pool


def chunked(jobs: list[tuple[int, Any, Any]]) -> list[tuple[list[int], list[tuple[Any, Any]]]]:
    """``(leaf, destination, source)`` copies as tasks of about :data:`CHUNK` bytes each: small leaves
    share a task, a large one is split. Each task is ``(its leaves, its (destination, source) pieces)``."""
    tasks: list[tuple[list[int], list[tuple[Any, Any]]]] = [([], [])]
    size = 0
    for leaf, dst, src in jobs:
        for start in range(0, len(src), CHUNK):
            if size >= CHUNK:
                tasks.append(([], []))
                size = 0
            piece = slice(start, start + CHUNK)
            leaves, pieces = tasks[-1]
            if not leaves or leaves[-1] != leaf:
                leaves.append(leaf)
            pieces.append((dst[piece], src[piece]))
            size += min(CHUNK, len(src) - start)
    return [task for task in tasks if task[1]]


def copy_pieces(pieces: list[tuple[Any, Any]]) -> None:
    import numpy as np

    for dst, src in pieces:
        np.copyto(dst, src)  # releases the GIL: the copies run in parallel


def copy_order(jobs: list[tuple[int, Any, int, bool]]) -> tuple[list[Any], list[Any]]:
    """The device copies split in the order they are queued: ``(urgent, deferred)``.

    Deferred copies read tensors only an optimizer's ``step()`` mutates (``Encoded.optimizer_owned``), so
    the compute stream waits for them at the next optimizer step instead of right away.
    """
    urgent = [job for job in jobs if not job[3]]
    deferred = [job for job in jobs if job[3]]
    return urgent, deferred


class OptimizerStepBarrier:
    """Makes the next ``step()`` of any torch optimizer wait for the copies added here: device copies (CUDA
    events) on its current stream, without the host waiting; host copies (futures) on the host.

    A global optimizer step pre-hook is registered while copies are pending. It is removed by
    :meth:`release` (the next save, ``wait()``, ``close()``), never by the step itself: torch iterates over
    its global hooks while it calls them, and a hook removed then breaks the step when another one follows
    (another stager's, at a step where the fast and the durable tier both saved). A failed host copy is
    raised by the first wait for it (that step or :meth:`release`), as a
    :class:`~vertexrt.errors.CheckpointError`.
    """

    def __init__(self) -> None:
        self._events: dict[Any, Any] = {}
        self._copies: list[tuple[Future[None], list[int]]] = []  # (future, the leaves it copies)
        self._hook: Any = None
        self._lock = threading.Lock()

    def add(self, device: Any, event: Any) -> None:
        with self._lock:
            self._events[device] = event
            self._hook_on()

    def add_copy(self, future: Future[None], leaves: list[int]) -> None:
        with self._lock:
            self._copies.append((future, leaves))
            self._hook_on()

    def release(self) -> None:
        """Order the pending device copies before whatever the current streams run next, wait for the host
        copies and remove the step hook.

        Raises:
            CheckpointError: a host copy failed (and no earlier wait raised it).
        """
        self._wait(remove_hook=True)

    def _wait(self, *, remove_hook: bool) -> None:
        import sys

        with self._lock:
            events, self._events = self._events, {}
            copies = list(self._copies)
            hook = None
            if remove_hook:
                hook, self._hook = self._hook, None
        if hook is not None:
            hook.remove()
        torch = sys.modules.get("torch")
        for device, event in events.items():
            assert torch is not None
            torch.cuda.current_stream(device).wait_event(event)
        for future, _ in copies:
            future.exception()  # waits
        with self._lock:  # each failure is raised by the one wait that takes it off the list
            mine = [copy for copy in copies if copy in self._copies]
            self._copies = [copy for copy in self._copies if copy not in mine]
        failed = [(future.exception(), leaves) for future, leaves in mine if future.exception() is not None]
        if failed:
            error, leaves = failed[0]
            raise CheckpointError(
                f"the background copy of checkpoint leaves {leaves} into host memory failed: {error!r}; the "
                f"save that staged them fails. {COPY_FAILURE_HINT}"
            ) from error

    def _hook_on(self) -> None:
        if self._hook is None:
            from torch.optim.optimizer import register_optimizer_step_pre_hook

            self._hook = register_optimizer_step_pre_hook(self._before_step)

    def _before_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        self._wait(remove_hook=False)  # idle until release(): see the class docstring

"""A restore's host bytes to the GPU: pinned bounce buffers filled by threads, copies queued in order.

Inside :func:`uploads` (one restore), :func:`copy_to_device` hands a CUDA target to an :class:`Uploader`:
host threads fill a few pinned bounce buffers and the caller's thread queues each non-blocking
host-to-device copy on the caller's stream before :meth:`Uploader.copy` returns, so anything the caller
queues next (``target.copy_``, ``load_state_dict``) runs after the bytes landed. Outside a restore, or for
a target the bytes cannot be copied into raw (:func:`byte_copyable`), the caller copies itself.

Example:
    >>> with uploads():
    ...     for source, target in pairs:
    ...         copy_to_device(source, target) or target.copy_(torch.from_numpy(source))
"""

from __future__ import annotations

import contextvars
import logging
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any

from vertexrt.checkpoint.staging import CHUNK, CudaHostRegistry, PinnedBlock

log = logging.getLogger(__name__)

_UPLOADER: contextvars.ContextVar[Uploader | None] = contextvars.ContextVar("vertexrt_uploader", default=None)


class Uploader:
    """Host bytes -> GPU tensors through ``slots`` bounce buffers (one pinned block) and non-blocking copies.

    :meth:`copy` returns once every copy of the tensor is queued on the caller's current stream: host
    threads only fill bounce buffers (half of the slots while the other half's copies run); the caller's
    thread queues the copies, so the stream runs them before anything the caller queues afterwards.
    """

    def __init__(self, slots: int = 8, chunk: int = CHUNK // 2, registry: Any = None) -> None:
        self.chunk = chunk
        self.registry = registry
        self._count = max(2, slots - slots % 2)
        self._block: PinnedBlock | None = None
        self._host: Any = None  # (slots, chunk) uint8 bounce buffers
        self._events: list[Any] = []
        self._pool: ThreadPoolExecutor | None = None
        self._half = 0

    def copy(self, source: Any, target: Any) -> None:
        """Queue ``target`` (contiguous GPU tensor) <- ``source`` (1-D uint8 host array of its bytes)."""
        import torch

        self._open()
        dest = target.detach().view(-1).view(torch.uint8)
        stream = torch.cuda.current_stream(target.device)
        half = self._count // 2
        starts = list(range(0, len(source), self.chunk))
        for first in range(0, len(starts), half):
            batch = starts[first : first + half]
            slots = [self._half * half + i for i in range(len(batch))]
            self._half ^= 1
            for slot in slots:
                if self._events[slot] is not None:
                    self._events[slot].synchronize()  # the slot's previous copy has left it
            fills = [
                (self._host[slot], source[start : start + self.chunk])
                for slot, start in zip(slots, batch, strict=True)
            ]
            self._fill(fills)
            bounce = torch.from_numpy(self._host)
            for slot, start in zip(slots, batch, strict=True):
                n = min(self.chunk, len(source) - start)
                with torch.cuda.stream(stream):
                    dest[start : start + n].copy_(bounce[slot, :n], non_blocking=True)
                    event = torch.cuda.Event()
                    event.record(stream)
                self._events[slot] = event

    def _open(self) -> None:
        import numpy as np

        if self._host is not None:
            return
        nbytes = self._count * self.chunk
        try:
            self._block = PinnedBlock(nbytes, self.registry or CudaHostRegistry())
            flat = self._block.array
        except Exception as exc:
            log.warning("could not pin %d bytes of restore bounce buffers (%s): slower copies", nbytes, exc)
            flat = np.empty(nbytes, dtype=np.uint8)
        self._host = flat.reshape(self._count, self.chunk)
        self._events = [None] * self._count
        self._pool = ThreadPoolExecutor(self._count // 2, thread_name_prefix="vertexrt-ckpt-upload")

    def _fill(self, fills: list[tuple[Any, Any]]) -> None:
        import numpy as np

        def run(pair: tuple[Any, Any]) -> None:
            dst, src = pair
            np.copyto(dst[: len(src)], src)  # releases the GIL: the fills run in parallel

        if len(fills) == 1 or self._pool is None:
            for pair in fills:
                run(pair)
            return
        list(self._pool.map(run, fills))

    def finish(self) -> None:
        """Wait until every queued copy has left the bounce buffers, then free them."""
        for event in self._events:
            if event is not None:
                event.synchronize()
        self._events = []
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        self._host = None
        block, self._block = self._block, None
        if block is not None:
            block.release()


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

    The copies are queued on the current stream before this returns. Applies within :func:`uploads`, when
    :func:`byte_copyable` and ``target`` is a CUDA tensor (else the caller copies with ``target.copy_``).
    """
    import torch

    if target.device.type != "cuda" or source.device.type != "cpu" or not byte_copyable(source, target):
        return False
    host = source.detach().resolve_conj().resolve_neg().contiguous().view(-1).view(torch.uint8).numpy()
    uploader = _UPLOADER.get()
    if uploader is None:
        return False
    uploader.copy(host, target)
    return True


def byte_copyable(source: Any, target: Any) -> bool:
    """Whether ``target``'s memory can take ``source``'s bytes as they are: contiguous, same dtype and shape,
    not empty, and no lazy conjugate / negative bit on ``target`` (its bytes would not mean its values)."""
    return bool(
        target.is_contiguous()
        and not target.is_conj()
        and not target.is_neg()
        and target.dtype == source.dtype
        and target.shape == source.shape
        and source.numel() > 0
    )

"""Rank, world size and the few CPU collectives (gloo side group) for the checkpoint manager and the vote.

torch is never imported here: ``torch.distributed`` counts only if the program already imported torch and
initialised a process group.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any


def torch_dist() -> Any | None:
    """``torch.distributed`` when a process group is initialised, else None."""
    torch = sys.modules.get("torch")
    if torch is None:
        return None
    dist = getattr(torch, "distributed", None)
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return None
    return dist


def resolve(rank: int | None, world_size: int | None) -> tuple[int, int]:
    """``(rank, world_size)``: the arguments, else :func:`vertexrt.distributed.world_info` (the one owner).

    Raises:
        ClusterSpecError: the cluster description is malformed (guessing "rank 0 of 1" would make every
            replica a writer).
    """
    if rank is not None and world_size is not None:
        return rank, world_size
    from vertexrt.distributed import world_info

    info = world_info()
    return (info.rank if rank is None else rank), (info.world_size if world_size is None else world_size)


def broadcast(value: Any, dist: Any | None, *, group: Any = None) -> Any:
    """Rank 0's ``value`` on every rank (no-op without torch.distributed), on the CPU side group (never the
    GPU), or on ``group`` (e.g. a :func:`thread_group` when called off the main thread)."""
    if dist is None or dist.get_world_size() == 1:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0, group=group if group is not None else cpu_group(dist))
    return box[0]


#: :func:`broadcast_bytes` sends consecutive buffers in runs of at most this many bytes (a larger one alone).
BROADCAST_RUN_BYTES = 64 << 20


def broadcast_bytes(
    buffers: Sequence[Any] | None,
    sizes: Sequence[int],
    dist: Any | None,
    *,
    group: Any = None,
    run_bytes: int = BROADCAST_RUN_BYTES,
) -> list[Any]:
    """Rank 0's byte buffers on every rank, sent as raw uint8 CPU tensors on the CPU side group (or
    ``group``), never pickled: the bulk of a state beside its small header, which :func:`broadcast` sends.

    ``buffers``: rank 0's bytes-like objects or 1-D uint8 arrays (None elsewhere); ``sizes``: their lengths,
    the same on every rank (rank 0's, e.g. sent ahead in that header). Consecutive buffers travel in runs of
    at most ``run_bytes`` (one broadcast each; a larger buffer alone, without a copy when it is writable).
    Rank 0 gets its ``buffers`` back; the others 1-D uint8 numpy arrays (views of one tensor per run).

    Example:
        >>> broadcast_bytes([b"header", b""], [6, 0], None)
        [b'header', b'']
    """
    if dist is None or dist.get_world_size() == 1:
        assert buffers is not None
        return list(buffers)
    import numpy as np
    import torch

    chief = dist.get_rank() == 0
    group = group if group is not None else cpu_group(dist)
    received: list[Any] = []
    for run in _runs(sizes, run_bytes):
        total = sum(sizes[i] for i in run)
        if chief:
            assert buffers is not None
            arrays = [np.frombuffer(buffers[i], dtype=np.uint8) for i in run]
            if len(arrays) == 1 and arrays[0].flags.writeable:
                flat = arrays[0]
            else:
                flat = np.concatenate(arrays) if arrays else np.empty(0, dtype=np.uint8)
            if len(flat) != total:
                raise ValueError(f"broadcast_bytes: buffers {run} hold {len(flat)} bytes, sizes say {total}")
            if total:
                dist.broadcast(torch.from_numpy(flat), src=0, group=group)
            continue
        tensor = torch.empty(total, dtype=torch.uint8)
        if total:
            dist.broadcast(tensor, src=0, group=group)
        flat = tensor.numpy()
        offset = 0
        for i in run:
            received.append(flat[offset : offset + sizes[i]])
            offset += sizes[i]
    if chief:
        assert buffers is not None
        return list(buffers)
    return received


def _runs(sizes: Sequence[int], run_bytes: int) -> list[list[int]]:
    """The indices of ``sizes`` in consecutive runs of at most ``run_bytes`` (a larger size alone)."""
    runs: list[list[int]] = []
    current: list[int] = []
    total = 0
    for index, size in enumerate(sizes):
        if current and total + size > run_bytes:
            runs.append(current)
            current, total = [], 0
        current.append(index)
        total += size
    if current:
        runs.append(current)
    return runs


def gather(value: Any, dist: Any | None, *, group: Any = None) -> list[Any] | None:
    """Every rank's ``value`` in rank order on rank 0, None on the others (one object gather: rank 0
    receives N small objects, every other rank sends one; nothing grows with N on the other ranks).

    Example:
        >>> gather({"files": 2}, None)
        [{'files': 2}]
    """
    if dist is None or dist.get_world_size() == 1:
        return [value]
    chief = dist.get_rank() == 0
    everyone: list[Any] | None = [None] * dist.get_world_size() if chief else None
    dist.gather_object(value, everyone, dst=0, group=group if group is not None else cpu_group(dist))
    return everyone


def scatter(values: list[Any] | None, dist: Any | None, *, group: Any = None) -> Any:
    """``values[rank]`` (given on rank 0 only, one per rank) on each rank: each rank receives only its own.

    Example:
        >>> scatter(["for rank 0"], None)
        'for rank 0'
    """
    if dist is None or dist.get_world_size() == 1:
        assert values is not None
        return values[0]
    box: list[Any] = [None]
    dist.scatter_object_list(
        box,
        values if dist.get_rank() == 0 else None,
        src=0,
        group=group if group is not None else cpu_group(dist),
    )
    return box[0]


def thread_group(dist: Any, timeout_s: float) -> Any:
    """A new gloo group for one background thread's collectives (never interleaved with the main thread's);
    every rank must create it at the same point. ``timeout_s`` bounds each of its collectives."""
    from datetime import timedelta

    return dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))


def all_gather(value: Any, dist: Any | None) -> list[Any]:
    """Every rank's ``value``, in rank order (one object all-gather on the CPU side group: never the GPU).

    Example:
        >>> all_gather({"loss": 0.5}, None)
        [{'loss': 0.5}]
    """
    if dist is None or dist.get_world_size() == 1:
        return [value]
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, value, group=cpu_group(dist))
    return everyone


def all_max(values: list[int], dist: Any | None) -> list[int]:
    """The element-wise maximum of ``values`` over all ranks (one blocking all-reduce of a CPU tensor on the
    CPU side group: never the GPU)."""
    if dist is None or dist.get_world_size() == 1:
        return list(values)
    import torch

    tensor = torch.tensor(values, dtype=torch.int64)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=cpu_group(dist))
    return [int(v) for v in tensor.tolist()]


class LateBroadcast:
    """Rank 0's few integers, sent with a non-blocking broadcast now and read at a later call.

    Every rank calls :meth:`start` and :meth:`result` at the same points, so all ranks read the same values
    at the same call, without waiting on the wire when they are read a step or more after they were sent.
    CPU tensors on :func:`cpu_group`: the GPU is never synchronised.
    """

    def __init__(self) -> None:
        self._pending: tuple[Any, Any] | None = None

    def start(self, values: list[int], dist: Any) -> None:
        import torch

        self.drain()
        tensor = torch.tensor(values, dtype=torch.int64)
        self._pending = (dist.broadcast(tensor, src=0, group=cpu_group(dist), async_op=True), tensor)

    def result(self) -> list[int] | None:
        """Rank 0's values of the last :meth:`start`, or None when none is in flight."""
        if self._pending is None:
            return None
        work, tensor = self._pending
        self._pending = None
        work.wait()
        return [int(v) for v in tensor.tolist()]

    def drain(self) -> None:
        """Wait for the broadcast in flight (before the process group goes away)."""
        self.result()


_CPU_GROUP: list[Any] = []  # [default group, its gloo side group] once created


def cpu_group(dist: Any) -> Any:
    """A process group for small CPU-tensor collectives: the default group under gloo, else a gloo side group.

    Votes and flags then never touch the GPU (no CUDA tensor, no ``.item()`` stalling on the stream). The side
    group is created on first use, which every rank reaches at the same collective call.
    """
    if dist.get_backend() == "gloo":
        return None
    world = dist.group.WORLD
    if not _CPU_GROUP or _CPU_GROUP[0] is not world:
        _CPU_GROUP[:] = [world, dist.new_group(backend="gloo")]
    return _CPU_GROUP[1]


# -- point to point on a dedicated gloo group (the fast checkpoint tier's peer copies) ---------------------


def new_gloo_group(dist: Any) -> Any:
    """A new gloo group of every rank, for point-to-point traffic on a background thread beside the main
    thread's collectives; every rank must call it at the same point (like any ``new_group``)."""
    return dist.new_group(backend="gloo")


def send_bytes(data: Any, dst: int, group: Any, dist: Any) -> list[Any]:
    """Start sending ``data`` (bytes or a writable 1-D uint8 array) to rank ``dst``: its length, then its
    bytes. Returns what to pass to :func:`wait_sent` (which keeps the buffers alive until then)."""
    import numpy as np
    import torch

    array = np.frombuffer(bytearray(data), dtype=np.uint8) if isinstance(data, bytes) else data
    size = torch.tensor([len(array)], dtype=torch.int64)
    sent: list[Any] = [size, dist.isend(size, dst=dst, group=group)]
    if len(array):
        payload = torch.from_numpy(array)
        sent += [payload, dist.isend(payload, dst=dst, group=group)]
    return sent


def wait_sent(sent: list[Any]) -> None:
    """Block until every send :func:`send_bytes` started has left."""
    for item in sent:
        if hasattr(item, "wait"):
            item.wait()


def recv_bytes(src: int, group: Any, dist: Any, limit: int) -> Any:
    """The next :func:`send_bytes` message from rank ``src`` (a 1-D uint8 numpy array).

    Raises:
        ValueError: the announced length is negative or above ``limit`` (nothing is allocated).
    """
    import torch

    size = torch.empty(1, dtype=torch.int64)
    dist.recv(size, src=src, group=group)
    nbytes = int(size[0])
    if not 0 <= nbytes <= limit:
        raise ValueError(f"rank {src} announced {nbytes} bytes, outside 0..{limit}")
    out = torch.empty(nbytes, dtype=torch.uint8)
    if nbytes:
        dist.recv(out, src=src, group=group)
    return out.numpy()

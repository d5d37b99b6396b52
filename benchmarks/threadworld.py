"""``torch.distributed`` for N ranks that are threads of one process: the scale simulation's process group.

Every collective is one method over :meth:`ThreadWorld.exchange` (each rank puts in one value and gets every
rank's, between two thread barriers); objects travel pickled, so each rank gets its own copy as it would
from gloo. Groups made by ``new_group`` are separate (the k-th ``new_group`` call of every rank is the same
group), so a background thread's collectives never mix with the loop's. Threads started by a rank's thread
are that rank's too (:meth:`ThreadWorld.installed` patches ``threading.Thread.start`` while installed).

Example:
    >>> world = ThreadWorld(4)
    >>> with world.installed():      # torch.distributed is this object until the block ends
    ...     world.run(lambda rank: torch.distributed.all_gather_object([None] * 4, rank))
"""

from __future__ import annotations

import contextlib
import pickle
import sys
import threading
from collections.abc import Callable, Iterator
from types import SimpleNamespace
from typing import Any

_TIMEOUT = 900.0  # seconds a collective waits for the other ranks before the run is declared broken


class _Group:
    def __init__(self, size: int) -> None:
        self.slots: list[Any] = [None] * size
        self.barrier = threading.Barrier(size, timeout=_TIMEOUT)


class _Done:
    """The handle of an ``async_op`` collective: the fake completes it before returning."""

    def wait(self, timeout: Any = None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


class ThreadWorld:
    """The subset of ``torch.distributed`` that vertexrt calls, for ``world_size`` rank threads."""

    def __init__(self, world_size: int) -> None:
        import torch.distributed as real

        self.world_size = world_size
        self.ReduceOp = real.ReduceOp
        self.group = SimpleNamespace(WORLD="world")
        self._local = threading.local()
        self._lock = threading.Lock()
        self._groups: dict[Any, _Group] = {"world": _Group(world_size)}
        self._groups_made = [0] * world_size  # new_group calls per rank (any of its threads)

    # -- who am I ---------------------------------------------------------------------------------------
    def bind(self, rank: int) -> None:
        """Make the calling thread rank ``rank``."""
        self._local.rank = rank

    def current_rank(self) -> int | None:
        """The calling thread's rank; None on a thread no rank started."""
        return getattr(self._local, "rank", None)

    def get_rank(self, group: Any = None) -> int:
        return int(self._local.rank)

    def get_world_size(self, group: Any = None) -> int:
        return self.world_size

    def get_backend(self, group: Any = None) -> str:
        return "gloo"

    def is_available(self) -> bool:
        return True

    def is_initialized(self) -> bool:
        return True

    def new_group(self, *args: Any, **kwargs: Any) -> Any:
        rank = self.get_rank()
        with self._lock:
            self._groups_made[rank] += 1
            key = ("group", self._groups_made[rank])
            self._groups.setdefault(key, _Group(self.world_size))
        return key

    def destroy_process_group(self, group: Any = None) -> None:
        pass

    # -- the one primitive ---------------------------------------------------------------------------------
    def exchange(self, value: Any, group: Any = None) -> list[Any]:
        """Every rank's ``value`` of this call, in rank order (every rank of ``group`` calls it)."""
        state = self._groups[group if group is not None else "world"]
        state.slots[self.get_rank()] = value
        state.barrier.wait()
        everyone = list(state.slots)
        state.barrier.wait()  # nobody writes the next call's value before everyone has read this one
        return everyone

    # -- collectives: one method each ------------------------------------------------------------------------
    def barrier(self, group: Any = None, **kwargs: Any) -> None:
        self.exchange(None, group)

    def broadcast_object_list(
        self, objects: list[Any], src: int = 0, group: Any = None, **kwargs: Any
    ) -> None:
        blobs = self.exchange(pickle.dumps(objects) if self.get_rank() == src else None, group)
        objects[:] = pickle.loads(blobs[src])

    def all_gather_object(self, out: list[Any], obj: Any, group: Any = None) -> None:
        out[:] = [pickle.loads(blob) for blob in self.exchange(pickle.dumps(obj), group)]

    def gather_object(
        self, obj: Any, gather_list: list[Any] | None = None, dst: int = 0, group: Any = None
    ) -> None:
        blobs = self.exchange(pickle.dumps(obj), group)
        if self.get_rank() == dst and gather_list is not None:
            gather_list[:] = [pickle.loads(blob) for blob in blobs]

    def scatter_object_list(
        self, out: list[Any], objects: list[Any] | None, src: int = 0, group: Any = None
    ) -> None:
        blobs = self.exchange(pickle.dumps(objects) if self.get_rank() == src else None, group)
        out[0] = pickle.loads(blobs[src])[self.get_rank()]

    def all_gather(self, out: list[Any], tensor: Any, group: Any = None, async_op: bool = False) -> Any:
        for target, value in zip(out, self.exchange(tensor.clone(), group), strict=True):
            target.copy_(value)
        return _Done() if async_op else None

    def broadcast(self, tensor: Any, src: int = 0, group: Any = None, async_op: bool = False) -> Any:
        values = self.exchange(tensor.clone() if self.get_rank() == src else None, group)
        tensor.copy_(values[src])
        return _Done() if async_op else None

    def all_reduce(self, tensor: Any, op: Any = None, group: Any = None, async_op: bool = False) -> Any:
        import torch

        stacked = torch.stack(self.exchange(tensor.clone(), group))
        if op == self.ReduceOp.MAX:
            reduced = stacked.max(dim=0).values
        elif op == self.ReduceOp.MIN:
            reduced = stacked.min(dim=0).values
        elif op in (None, self.ReduceOp.SUM):
            reduced = stacked.sum(dim=0)
        else:
            raise NotImplementedError(f"ThreadWorld.all_reduce: op {op} (add it here)")
        tensor.copy_(reduced)
        return _Done() if async_op else None

    # -- running ranks ------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def installed(self) -> Iterator[ThreadWorld]:
        """``torch.distributed`` (the attribute and ``sys.modules`` entry) is this world inside the block."""
        import torch
        import torch.distributed as real
        import torch.distributed.checkpoint  # noqa: F401 - imported now: submodule imports need the real package
        import torch.distributed.tensor  # noqa: F401

        start = threading.Thread.start
        world = self

        def start_as_rank(thread: threading.Thread) -> None:
            rank = world.current_rank()
            if rank is not None:
                run = thread.run

                def run_as_rank() -> None:
                    world.bind(rank)
                    run()

                thread.run = run_as_rank  # type: ignore[method-assign]
            start(thread)

        threading.Thread.start = start_as_rank  # type: ignore[method-assign]
        torch.distributed = self  # type: ignore[assignment]
        sys.modules["torch.distributed"] = self  # type: ignore[assignment]
        try:
            yield self
        finally:
            threading.Thread.start = start  # type: ignore[method-assign]
            torch.distributed = real
            sys.modules["torch.distributed"] = real

    def run(self, rank_main: Callable[[int], Any]) -> list[Any]:
        """``rank_main(rank)`` on a thread per rank; the results in rank order (the first error re-raised)."""
        results: list[Any] = [None] * self.world_size
        errors: list[BaseException] = []

        def main(rank: int) -> None:
            self.bind(rank)
            try:
                results[rank] = rank_main(rank)
            except BaseException as exc:
                errors.append(exc)
                for state in list(self._groups.values()):
                    state.barrier.abort()  # the other ranks stop waiting for this one

        threads = [
            threading.Thread(target=main, args=(rank,), name=f"rank-{rank}", daemon=True)
            for rank in range(self.world_size)
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        if errors:
            raise errors[0]
        return results

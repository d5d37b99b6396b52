"""A background reader thread with a bounded queue; its errors surface in the iterating thread.

Example:
    >>> with Prefetcher(lambda: read_chunks(), depth=4) as chunks:
    ...     for chunk in chunks: ...
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterator
from types import TracebackType
from typing import Generic, TypeVar

from vertexrt.errors import DataError

T = TypeVar("T")

_POLL = 0.1


class _Done:
    pass


class _Failed:
    def __init__(self, error: BaseException):
        self.error = error


class Prefetcher(Generic[T]):
    """Run ``make()`` (an iterator factory) in a daemon thread, ``depth`` items ahead of the consumer.

    The factory is called inside the thread, so files are opened there, and closed there: ``close()`` (or
    leaving the ``with`` block, or dropping the iterator) stops the thread, which closes the iterator
    (a generator's ``finally`` blocks run) before it ends; an exception in the thread is re-raised by
    ``next()`` in the consumer.
    """

    def __init__(self, make: Callable[[], Iterator[T]], depth: int = 2, name: str = "vertexrt-prefetch"):
        self._queue: queue.Queue[object] = queue.Queue(maxsize=max(1, depth))
        self._stop = threading.Event()
        self._finished = False
        self._thread = threading.Thread(target=self._run, args=(make,), name=name, daemon=True)
        self._thread.start()

    def _run(self, make: Callable[[], Iterator[T]]) -> None:
        item: object
        try:
            items = make()
            try:
                for value in items:
                    if not self._put(value):
                        return
            finally:  # what the reader holds (open files, fetches ahead) is released before the thread ends
                close = getattr(items, "close", None)
                if close is not None:
                    close()
            item = _Done()
        except BaseException as err:  # noqa: BLE001 - every failure must reach the consumer
            item = _Failed(err)
        self._put(item)

    def _put(self, item: object) -> bool:
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=_POLL)
                return True
            except queue.Full:
                continue
        return False

    def __iter__(self) -> Iterator[T]:
        return self

    def __next__(self) -> T:
        if self._finished:
            raise StopIteration
        while True:
            try:
                item = self._queue.get(timeout=_POLL)
                break
            except queue.Empty:
                if not self._thread.is_alive() and self._queue.empty():
                    self._finished = True
                    raise DataError("the vertexrt prefetch thread ended without a result") from None
        if isinstance(item, _Done):
            self._finished = True
            raise StopIteration
        if isinstance(item, _Failed):
            self._finished = True
            self.close()
            raise item.error
        return item  # type: ignore[return-value]

    def close(self) -> None:
        """Stop the thread (it exits at its next queue operation) and drop what it queued."""
        self._stop.set()
        try:
            while True:
                self._queue.get_nowait()
        except queue.Empty:
            pass
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=5)

    def __enter__(self) -> Prefetcher[T]:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def __del__(self) -> None:
        self._stop.set()

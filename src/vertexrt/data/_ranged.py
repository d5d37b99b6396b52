"""A Cloud Storage object read forward by range requests, the next ranges fetched while the reader works.

The bytes from ``start`` to ``end`` (or the object's end) are fetched as fixed ranges of
:data:`RANGE_SIZE` bytes, :data:`READ_AHEAD` of them ahead of the range being read, as coroutines on
gcsfs's event loop (its I/O thread; no thread of ours): fetching the next bytes overlaps checking and
parsing these, and memory stays bounded by ``(READ_AHEAD + 1) x RANGE_SIZE`` per open object. Each fetch
runs under the storage deadline and retry policy of :mod:`vertexrt.retries`. The ranges depend only on
``start``, ``end`` and the size, so the requests made for a file are deterministic; past ``end`` (the record
that crosses it) reads are small direct requests of :data:`TAIL_READ` bytes at most.

A fetch that fails is raised by the :meth:`RangedReader.read` that needs its bytes, as the same typed
:class:`~vertexrt.errors.DataError` a direct read raises; :meth:`RangedReader.close` cancels the fetches in
flight and returns once they have ended (no request outlives it).
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

from vertexrt.errors import DataError

log = logging.getLogger(__name__)

RANGE_SIZE = 8 << 20
"""Bytes per range request: large sequential reads are what remote stores are fast at."""

READ_AHEAD = 2
"""Ranges fetched ahead of the one being read."""

TAIL_READ = 64 << 10
"""Bytes asked for per read past the end of a byte range: only the record that crosses the end is wanted."""

_SETTLE_SECONDS = 10.0


def storage_call(operation: str, uri: str, fn: Any, *args: Any, **kwargs: Any) -> Any:
    """:func:`vertexrt.retries.call`, its :class:`~vertexrt.errors.StorageError` raised as a DataError."""
    from vertexrt import retries
    from vertexrt.errors import StorageError

    try:
        return retries.call(operation, uri, fn, *args, **kwargs)
    except StorageError as err:
        raise DataError(str(err)) from err


def unreadable(uri: str, err: OSError) -> DataError:
    """The typed error for a data file that is gone or may not be read."""
    if isinstance(err, FileNotFoundError):
        return DataError(f"{uri}: file not found (was it deleted or renamed after the dataset was opened?)")
    return DataError(f"{uri}: permission denied ({err}); grant the job's service account read access")


class RangedReader:
    """Bytes ``[start, size)`` of the object ``path`` on the async filesystem ``fs`` (gcsfs), read forward.

    ``size`` is the object's size (from the listing: no metadata request here). With ``end``, read-ahead
    stops there and a read does not cross it; reads past it are direct requests of at most
    :data:`TAIL_READ` bytes. Opening fetches the first range, so a missing object fails here, as an open does.

    Example:
        >>> f = RangedReader(fs, "b/data/part-0.tfrecord", "gs://b/data/part-0.tfrecord", 0, 96 << 20)
        >>> first = f.read(8 << 20)
    """

    def __init__(
        self,
        fs: Any,
        path: str,
        uri: str,
        start: int,
        size: int,
        end: int | None = None,
    ):
        self._fs = fs
        self._path = path
        self._uri = uri
        self._size = size
        self._pos = start  # the next byte read() hands out
        self._stop = size if end is None else min(end, size)  # read-ahead ends here
        self._next = start  # the next byte to request
        self._ahead = READ_AHEAD
        self._range_size = RANGE_SIZE
        self._fetches: deque[tuple[int, Future[bytes]]] = deque()  # (first byte, fetch), in order
        self._running: set[asyncio.Task[bytes]] = set()  # fetches under way (used on the loop only)
        self._piece = b""  # the range being read
        self._offset = 0  # bytes of it handed out
        self.closed = False
        try:
            if self._pos < self._stop:
                self._piece = self._take()
        except BaseException:
            self.close()
            raise

    def readable(self) -> bool:
        return True

    def read(self, size: int = -1) -> bytes:
        """Up to ``size`` bytes (all that is left for -1): fewer only at ``end`` or the object's end."""
        if self.closed:
            raise DataError(f"{self._uri}: read after close")
        if size < 0:
            size = self._size - self._pos
        parts: list[bytes] = []
        while size > 0:
            left = len(self._piece) - self._offset
            if not left:
                if self._pos >= self._stop:
                    if parts:
                        break  # a read stops at ``end``
                    return self._direct(size)
                self._piece, self._offset = self._take(), 0
                left = len(self._piece)
                if not left:
                    break
            take = min(size, left)
            if take == len(self._piece):
                parts.append(self._piece)  # a whole range: handed out as it came, no copy
            else:
                parts.append(self._piece[self._offset : self._offset + take])
            self._offset += take
            self._pos += take
            size -= take
        return parts[0] if len(parts) == 1 else b"".join(parts)

    def close(self) -> None:
        """Cancel the fetches in flight and wait until they have ended."""
        if self.closed:
            return
        self.closed = True
        self._piece = b""
        pending = [fetch for _, fetch in self._fetches if not fetch.done()]
        self._fetches.clear()
        if not pending:
            return
        for fetch in pending:
            fetch.cancel()
        settled = asyncio.run_coroutine_threadsafe(self._settle(), self._fs.loop)
        try:
            settled.result(_SETTLE_SECONDS)
        except FutureTimeout:  # pragma: no cover - a cancelled request that does not end
            log.warning("read-ahead of %s did not stop within %g s", self._uri, _SETTLE_SECONDS)

    def _take(self) -> bytes:
        """The next range, waited for; the fetches ahead are topped up first (to ``READ_AHEAD`` after it)."""
        self._fill()
        first, fetch = self._fetches.popleft()
        try:
            data = fetch.result()
        except OSError as err:
            if isinstance(err, (FileNotFoundError, PermissionError)):
                raise unreadable(self._uri, err) from err
            raise
        except Exception as err:
            from vertexrt.errors import StorageError

            if isinstance(err, StorageError):
                raise DataError(str(err)) from err
            raise
        expected = min(first + self._range_size, self._stop) - first
        if len(data) < expected:  # the object is shorter than listed: its data ends here
            self._size = self._stop = self._next = first + len(data)
        return data

    def _fill(self) -> None:
        while len(self._fetches) <= self._ahead and self._next < self._stop:
            end = min(self._next + self._range_size, self._stop)
            fetch = asyncio.run_coroutine_threadsafe(self._fetch(self._next, end), self._fs.loop)
            self._fetches.append((self._next, fetch))
            self._next = end

    async def _fetch(self, start: int, end: int) -> bytes:
        from vertexrt import retries

        task = asyncio.current_task()
        assert task is not None
        self._running.add(task)
        try:
            return await retries.call_async(
                "reading", self._uri, lambda: self._fs._cat_file(self._path, start=start, end=end)
            )
        finally:
            self._running.discard(task)

    async def _settle(self) -> None:
        """On the loop: cancel the fetches under way and wait for them to end."""
        running = list(self._running)
        for task in running:
            task.cancel()
        await asyncio.gather(*running, return_exceptions=True)

    def _direct(self, size: int) -> bytes:
        """A read past ``end``: one small request."""
        stop = min(self._pos + min(size, TAIL_READ), self._size)
        if stop <= self._pos:
            return b""
        data: bytes = storage_call(
            "reading", self._uri, self._fs.cat_file, self._path, start=self._pos, end=stop
        )
        self._pos += len(data)
        return data


class RangedFile:
    """The object ``path`` of ``size`` bytes as a read-only, seekable file for random-access readers
    (pyarrow's Parquet reader: the footer, then the column chunks it needs).

    Each :meth:`read` fetches exactly the bytes asked for, as a :class:`RangedReader` of ``[pos, pos + n)``
    (ranges of :data:`RANGE_SIZE` fetched concurrently, each under the storage deadline and retry policy,
    a failure raised as the typed :class:`~vertexrt.errors.DataError` naming ``uri``); seeking and the size
    cost no request. So the requests a reader makes depend only on what it reads, never the whole object.

    Example:
        >>> f = RangedFile(fs, "b/t/part-0.parquet", "gs://b/t/part-0.parquet", source.size)
        >>> pyarrow.parquet.ParquetFile(pyarrow.PythonFile(f, mode="r"))
    """

    def __init__(self, fs: Any, path: str, uri: str, size: int):
        self._fs = fs
        self._path = path
        self._uri = uri
        self._size = size
        self._pos = 0
        self.closed = False

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = 0) -> int:
        base = {0: 0, 1: self._pos, 2: self._size}.get(whence)
        if base is None or base + offset < 0:
            raise DataError(f"{self._uri}: cannot seek to {offset} from {whence} (size {self._size})")
        self._pos = base + offset
        return self._pos

    def read(self, size: int = -1) -> bytes:
        """``size`` bytes from the position (fewer at the end; all that is left for -1)."""
        if self.closed:
            raise DataError(f"{self._uri}: read after close")
        end = self._size if size < 0 else min(self._pos + size, self._size)
        if end <= self._pos:
            return b""
        reader = RangedReader(self._fs, self._path, self._uri, self._pos, self._size, end)
        try:
            data = reader.read(end - self._pos)
        finally:
            reader.close()
        self._pos += len(data)
        return data

    def close(self) -> None:
        self.closed = True

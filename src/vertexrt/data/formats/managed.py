"""Vertex managed-dataset exports: JSONL lines that name objects (images, text, video) and their labels.

A TrainingPipeline over a managed image / text / video dataset hands the job JSONL files
(``AIP_DATA_FORMAT=jsonl``) whose lines reference the user's objects, e.g.
``{"imageGcsUri": "gs://b/x.jpg", "classificationAnnotation": {"displayName": "cat"}}``. These formats
read the lines, fetch the referenced objects in parallel (bounded concurrency and bytes ahead of the
consumer, retried within the storage deadline), and map display names to integer ids that are the same
on every rank (the sorted names of every line of every file, unless ``classes`` is given). An object is
named by a ``gs://`` URI or a ``/gcs/`` path; anything else (a local path, ``file://``, ``http://``) is a
bad record, never read.

Records: ``{"path", "bytes" (image, video) or "text" (text), "label" (the id when the line has exactly one
classification label, else None), "labels" (every classification id), "json" (the parsed line)}``, plus
``"boxes"`` (``[xMin, yMin, xMax, yMax]``, normalised) and ``"box_labels"`` for bounding boxes and
``"segments"`` (``[start, end]`` seconds) and ``"segment_labels"`` for video time segments.

Example:
    >>> ds = vertexrt.data.open_dataset(format=VertexImage())        # AIP_TRAINING_DATA_URI
    >>> val = vertexrt.data.validation_dataset(format=VertexImage(classes=ds.format.classes))
    >>> next(iter(ds))["label"]
    3
"""

from __future__ import annotations

import copy
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, ClassVar

from vertexrt.data._io import MAX_RECORD_BYTES, compression_for
from vertexrt.data.formats._lines import line_lists, locate
from vertexrt.data.formats.base import Errors, FileSource, Format
from vertexrt.errors import DataError, PathError, StorageError, VertexrtError

if TYPE_CHECKING:
    from concurrent.futures import Future

CLASSIFICATION = ("classificationAnnotation", "classificationAnnotations")
BOXES = "boundingBoxAnnotations"
SEGMENTS = "timeSegmentAnnotations"
BATCH = 64
"""Most lines per fetch batch (and per chunk handed to the cursor machinery)."""
MAX_BYTES_AHEAD = 256 << 20
"""Default bound on the fetched object bytes held ahead of the consumer."""

Raw = tuple[bytes, Any, Any]
"""``(line, parsed line or None, object bytes | error message | None)``."""


class Managed(Format):
    """Base of the managed-dataset formats; see the module docstring.

    Args:
        classes: display names in label-id order; default the sorted names found in all the files
            (every rank reads the same files, so ids agree). Pass the training set's ``classes`` to the
            validation and test sets. A name outside ``classes`` is a bad record.
        fetch: fetch the referenced objects (False: records carry ``path`` only, e.g. for large videos).
        concurrency: objects fetched at once.
        ahead: fetch batches of ``64`` lines kept in flight ahead of the consumer.
        max_record_bytes: a longer line or object is a bad record (default 256 MiB).
        retries: attempts after a transient error (not for a missing object) before it is a bad record;
            every fetch also ends by the storage deadline (``VERTEXRT_STORAGE_TIMEOUT``, see
            :mod:`vertexrt.retries`), a stalled one as a bad record.
        max_bytes_ahead: bytes of fetched objects held at once, the batch being consumed and those fetched
            ahead of it (default 256 MiB, estimated by the largest object so far): fewer objects are
            fetched ahead when they are large (at least one at a time).
    """

    uri_keys: ClassVar[tuple[str, ...]] = ()

    def __init__(
        self,
        classes: Sequence[str] | None = None,
        *,
        fetch: bool = True,
        concurrency: int = 32,
        ahead: int = 4,
        max_record_bytes: int = MAX_RECORD_BYTES,
        retries: int = 3,
        compression: str | None = None,
        max_bytes_ahead: int = MAX_BYTES_AHEAD,
    ):
        if concurrency < 1 or ahead < 1 or retries < 0 or max_bytes_ahead < 1:
            raise DataError(
                f"{type(self).__name__}(concurrency={concurrency}, ahead={ahead}, retries={retries}, "
                f"max_bytes_ahead={max_bytes_ahead}): concurrency, ahead and max_bytes_ahead must be >= 1, "
                "retries >= 0"
            )
        self.classes = list(classes) if classes is not None else None
        self.fetch = bool(fetch)
        self.concurrency = int(concurrency)
        self.ahead = int(ahead)
        self.max_record_bytes = int(max_record_bytes)
        self.retries = int(retries)
        self.compression = compression
        self.max_bytes_ahead = int(max_bytes_ahead)

    def for_sources(self, sources: Any) -> Managed:
        if self.classes is not None:
            return self
        import orjson

        names: set[str] = set()
        for source in sources:
            compression = compression_for(source.uri, self.compression)
            for _, lines in line_lists(
                source.uri, compression, 0, Errors("skip"), limit=self.max_record_bytes
            ):
                for line in lines:
                    try:
                        obj = orjson.loads(line)
                    except orjson.JSONDecodeError:
                        continue  # reported when the line is read
                    if isinstance(obj, dict):
                        names.update(display_names(obj))
        new = copy.copy(self)
        new.classes = sorted(names)
        return new

    def object_uri(self, obj: dict[str, Any]) -> str | None:
        """The ``gs://`` URI or ``/gcs/`` path of the object a parsed line names (None: nothing to fetch).

        Raises:
            DataError: the line names something else (see :func:`checked_object_uri`).
        """
        for key in self.uri_keys:
            value = obj.get(key)
            if isinstance(value, str) and value:
                return checked_object_uri(key, value)
        return None

    def read(
        self, source: FileSource, start: int, end: int | None, errors: Errors
    ) -> Iterator[tuple[int, list[Raw]]]:
        import orjson

        compression = compression_for(source.uri, self.compression)
        fetcher = (
            _Fetcher(self.concurrency, self.max_record_bytes, self.retries, self.max_bytes_ahead)
            if self.fetch
            else None
        )
        pending: deque[tuple[int, list[tuple[bytes, Any]], list[Any] | None]] = deque()
        try:
            for pos, lines in line_lists(source.uri, compression, start, errors, limit=self.max_record_bytes):
                raws = list(filter(None, lines))
                i = 0
                while i < len(raws):
                    room = fetcher.room(BATCH) if fetcher is not None else BATCH
                    while not room and pending:  # the byte budget is spent: hand out the oldest first
                        yield _finish(pending.popleft(), fetcher)
                        room = fetcher.room(BATCH) if fetcher is not None else BATCH
                    parsed: list[tuple[bytes, Any]] = []
                    uris: list[str | None] = []
                    objects = 0  # lines of this batch with an object to fetch: at most ``room``
                    while i < len(raws) and len(parsed) < BATCH and objects < max(room, 1):
                        try:
                            obj = orjson.loads(raws[i])
                        except orjson.JSONDecodeError:
                            obj = None
                        parsed.append((raws[i], obj if isinstance(obj, dict) else None))
                        uris.append(self._fetchable(parsed[-1][1]))
                        objects += uris[-1] is not None
                        i += 1
                    fetches = fetcher.submit(uris) if fetcher is not None else None
                    pending.append((pos, parsed, fetches))  # a repeated position continues the read
                    while len(pending) > self.ahead:
                        yield _finish(pending.popleft(), fetcher)
            while pending:
                yield _finish(pending.popleft(), fetcher)
        finally:
            if fetcher is not None:
                fetcher.close()

    def _fetchable(self, obj: dict[str, Any] | None) -> str | None:
        """The object to fetch for a parsed line; None for none, or one refused (reported at decoding)."""
        try:
            return self.object_uri(obj) if obj is not None else None
        except DataError:
            return None

    def ignorable(self, raw: Raw) -> bool:
        return not raw[0].strip()

    def decoder(self) -> Callable[[Raw], dict[str, Any]]:
        import orjson

        ids = {name: i for i, name in enumerate(self.classes or [])}
        classes = self.classes
        fetch = self.fetch

        def label(name: Any) -> int:
            found = ids.get(name)
            if found is None:
                raise DataError(
                    f"label {name!r} is not one of the classes {_short(classes)}; pass classes=[...] naming "
                    "it (the training set's ds.format.classes), or leave classes unset"
                )
            return found

        def decode(raw: Raw) -> dict[str, Any]:
            line, obj, payload = raw
            if obj is None:
                obj = orjson.loads(line)  # raises the JSON error for the message
                if not isinstance(obj, dict):
                    raise DataError(f"a line must be a JSON object, not {type(obj).__name__}")
            uri = self.object_uri(obj)
            if isinstance(payload, str):
                raise DataError(payload)
            record = self.record(obj, uri, payload if fetch else None)
            labels = [label(a.get("displayName")) for a in _annotations(obj, CLASSIFICATION)]
            record["labels"] = labels
            record["label"] = labels[0] if len(labels) == 1 else None
            boxes = _annotations(obj, (BOXES,))
            if boxes:
                record["boxes"] = [[_number(b, k) for k in ("xMin", "yMin", "xMax", "yMax")] for b in boxes]
                record["box_labels"] = [label(b.get("displayName")) for b in boxes]
            segments = _annotations(obj, (SEGMENTS,))
            if segments:
                record["segments"] = [[_seconds(s, k) for k in ("startTime", "endTime")] for s in segments]
                record["segment_labels"] = [label(s.get("displayName")) for s in segments]
            record["json"] = obj
            return record

        return decode

    def record(self, obj: dict[str, Any], uri: str | None, data: bytes | None) -> dict[str, Any]:
        """The format's own fields of one record (before labels)."""
        if uri is None:
            raise DataError(f"the line has none of the keys {list(self.uri_keys)} naming its object")
        return {"path": uri, "bytes": data}

    def describe(self, raw: Raw, origins: list[tuple[Any, int]], error: Exception) -> str:
        for source, position in origins:
            found = locate(source.uri, compression_for(source.uri, self.compression), position, raw[0])
            if found is not None:
                return f"{source.uri}:{found[0]} (byte {found[1]}): {error}"
        where = origins[0][0].uri if origins else "?"
        return f"{where}: bad line {raw[0][:80]!r}: {error}"


class VertexImage(Managed):
    """Image classification (single / multi-label) and bounding-box exports (``imageGcsUri``)."""

    name = "vertex-image"
    uri_keys = ("imageGcsUri",)


class VertexVideo(Managed):
    """Video classification / action / tracking exports (``videoGcsUri``, ``timeSegmentAnnotations``)."""

    name = "vertex-video"
    uri_keys = ("videoGcsUri",)


class VertexText(Managed):
    """Text exports: inline ``textContent`` or a ``textGcsUri`` object (read as UTF-8) in ``"text"``."""

    name = "vertex-text"
    uri_keys = ("textGcsUri",)

    def record(self, obj: dict[str, Any], uri: str | None, data: bytes | None) -> dict[str, Any]:
        content = obj.get("textContent")
        if isinstance(content, str):
            return {"path": None, "text": content}
        if uri is None:
            raise DataError("the line has neither textContent nor textGcsUri")
        try:
            text = data.decode("utf-8") if data is not None else None
        except UnicodeDecodeError as err:
            raise DataError(f"{uri}: not UTF-8 text ({err})") from None
        return {"path": uri, "text": text}


FORMATS: dict[str, type[Managed]] = {f.name: f for f in (VertexImage, VertexText, VertexVideo)}
"""The managed-dataset formats by name (``format="vertex-image"`` ...)."""


def format_for_line(obj: Any) -> Managed | None:
    """The managed format a parsed export line belongs to (by its object key), or None.

    Example:
        >>> format_for_line({"imageGcsUri": "gs://b/x.jpg"})
        VertexImage(classes=None, ...)
    """
    if not isinstance(obj, dict):
        return None
    if "textContent" in obj:
        return VertexText()
    for cls in FORMATS.values():
        if any(key in obj for key in cls.uri_keys):
            return cls()
    return None


def sniff(sources: Sequence[FileSource], compression: str | None = None) -> Managed | None:
    """The managed format of the first line of the first non-empty file, or None (plain JSONL)."""
    import orjson

    for source in sources:
        if not source.size:
            continue
        comp = compression_for(source.uri, compression)
        for _, lines in line_lists(source.uri, comp, 0, Errors("skip"), limit=1 << 20):
            for line in lines:
                if line.strip():
                    try:
                        return format_for_line(orjson.loads(line))
                    except orjson.JSONDecodeError:
                        return None
        return None
    return None


def display_names(obj: dict[str, Any]) -> set[str]:
    """Every annotation display name of a parsed line."""
    found = _annotations(obj, (*CLASSIFICATION, BOXES, SEGMENTS))
    return {a["displayName"] for a in found if isinstance(a.get("displayName"), str)}


def _annotations(obj: dict[str, Any], keys: Sequence[str]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for key in keys:
        value = obj.get(key)
        if isinstance(value, dict):
            out.append(value)
        elif isinstance(value, list):
            out.extend(v for v in value if isinstance(v, dict))
    return out


def _number(annotation: dict[str, Any], key: str) -> float:
    value = annotation.get(key)
    if not isinstance(value, int | float) or isinstance(value, bool):
        raise DataError(f"annotation {annotation.get('displayName')!r}: {key}={value!r} is not a number")
    return float(value)


def _seconds(annotation: dict[str, Any], key: str) -> float:
    """A Duration as exported (``"1.5s"``) or a plain number of seconds."""
    value = annotation.get(key)
    if isinstance(value, str) and value.endswith("s"):
        try:
            return float(value[:-1])
        except ValueError:
            pass
    if isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    raise DataError(f"annotation {annotation.get('displayName')!r}: {key}={value!r} is not a duration")


def _short(classes: Sequence[str] | None) -> str:
    names = list(classes or [])
    return str(names) if len(names) <= 20 else f"{names[:20]} ... ({len(names)} classes)"


def checked_object_uri(key: str, value: str) -> str:
    """``value`` when it names a Cloud Storage object: a ``gs://BUCKET/OBJECT`` URI or a
    ``/gcs/BUCKET/OBJECT`` path (read through the mount, or as ``gs://`` when the bucket is not
    mounted), validated by :mod:`vertexrt.uris` so that it cannot leave its bucket.

    Raises:
        DataError: anything else (a local path, ``file://``, ``http(s)://``, another scheme, a bucket alone).
    """
    from vertexrt import uris

    problem = "it is not a gs://BUCKET/OBJECT URI or a /gcs/BUCKET/OBJECT path"
    if uris.is_gcs(value) or uris.is_fuse(value):
        try:
            _, obj = uris.split(value)
        except PathError as err:
            problem = str(err)
        else:
            if obj and not obj.endswith("/"):
                return value
            problem = "it names a bucket or a prefix, not an object"
    shown = uris.redact(value)
    raise DataError(
        f"{key}={shown[:200]!r}: {problem}; an export line names a Cloud Storage object (local paths, "
        "file://, http(s):// and other schemes are refused): fix the export, or skip such lines with "
        "on_error='skip'"
    )


def _finish(
    item: tuple[int, list[tuple[bytes, Any]], list[Any] | None], fetcher: _Fetcher | None
) -> tuple[int, list[Raw]]:
    pos, parsed, fetches = item
    payloads = (
        fetcher.results(fetches) if fetcher is not None and fetches is not None else [None] * len(parsed)
    )
    return pos, [(line, obj, payload) for (line, obj), payload in zip(parsed, payloads, strict=True)]


class _Fetcher:
    """Reads whole objects, at most ``concurrency`` at once and about ``budget`` bytes ahead of the consumer;
    each result is the bytes or an error message.

    Cloud Storage objects are fetched as coroutines on gcsfs's event loop (no thread per request), local
    and FUSE files by a thread pool. Every fetch runs under the storage deadline and retry policy of
    :mod:`vertexrt.retries` (``VERTEXRT_STORAGE_TIMEOUT``, at most ``retries`` retries); a missing object
    is not retried, and what is not a regular file (a FIFO, a device) is refused before it is opened.
    """

    def __init__(self, concurrency: int, limit: int, retries: int, budget: int):
        from concurrent.futures import ThreadPoolExecutor

        self._concurrency = concurrency
        self._pool = ThreadPoolExecutor(concurrency, thread_name_prefix="vertexrt-fetch")
        self._semaphores: dict[Any, Any] = {}  # event loop -> its asyncio.Semaphore(concurrency)
        self._limit = limit
        self._retries = retries
        self._budget = budget
        self._held: list[Future[Any]] = []  # fetches started and not yet handed to the consumer
        self._largest: int | None = None  # the largest object fetched so far (the estimate for the next)
        self._buckets: dict[str, Any] = {}  # bucket -> gcsfs: one lookup per bucket, not per object

    def room(self, most: int) -> int:
        """How many more objects may start now without holding more than the byte budget, the batch being
        consumed included (estimated by the largest object seen so far; 1 at the start, when nothing is
        held, to learn a size)."""
        size = 0
        for future in self._held:
            if future.done():
                payload = future.result()
                held = len(payload) if isinstance(payload, bytes) else 0  # an error message: nothing
                self._largest = max(self._largest or 0, held)
                size += held
            else:
                size += self._largest or 0
        if self._largest is None:
            return 0 if self._held else 1
        # half the budget ahead, so that with the batch the consumer holds (at most as much) it is kept
        return max(0, min(most, (self._budget // 2 - size) // max(self._largest, 1)))

    def _resolve(self, uri: str) -> tuple[Any, str]:
        """``paths.filesystem(uri)``; for ``gs://`` the filesystem is looked up once per bucket (the URI is
        still checked by :func:`vertexrt.paths.split_gcs` each time)."""
        from vertexrt import paths

        if not paths.is_gcs(uri):
            return paths.filesystem(uri)
        bucket, obj = paths.split_gcs(uri)
        fs = self._buckets.get(bucket)
        if fs is None:
            fs, path = paths.filesystem(uri)
            if not paths.is_gcs(fs.unstrip_protocol(path)):  # the FUSE mount serves it: per object
                return fs, path
            self._buckets[bucket] = fs
            return fs, path
        return fs, f"{bucket}/{obj}"

    def submit(self, uris: list[str | None]) -> list[Any]:
        """Start fetching ``uris`` (None: nothing to fetch); :meth:`results` waits for them."""
        import asyncio

        from fsspec.asyn import AsyncFileSystem

        slots: list[Any] = [None] * len(uris)
        for i, uri in enumerate(uris):
            if not uri:
                continue
            try:
                fs, path = self._resolve(uri)
            except VertexrtError as err:  # a URI outside what paths accepts
                slots[i] = f"{uri}: {err}"
                continue
            if isinstance(fs, AsyncFileSystem) and fs.loop is not None:
                slots[i] = asyncio.run_coroutine_threadsafe(
                    self._fetch_async(fs.loop, fs, path, uri), fs.loop
                )
            else:
                slots[i] = self._pool.submit(self._fetch, fs, path, uri)
            self._held.append(slots[i])
        return slots

    def results(self, slots: list[Any]) -> list[bytes | str | None]:
        """Wait for the fetches of :meth:`submit`; one payload per URI, in order. They are no longer held."""
        from concurrent.futures import Future

        out = [f.result() if isinstance(f, Future) else f for f in slots]
        done = {id(f) for f in slots if isinstance(f, Future)}
        if done:
            self._held = [f for f in self._held if id(f) not in done]
            sizes = [len(p) if isinstance(p, bytes) else 0 for p in out]
            self._largest = max(self._largest or 0, *sizes)
        return out

    def _fetch(self, fs: Any, path: str, uri: str) -> bytes | str:
        from vertexrt import paths, retries

        try:
            if paths.is_local_filesystem(fs):  # a local or FUSE file: read as such, not through fsspec
                return self._check(uri, _read_regular(path, self._limit + 1))
            return self._check(
                uri,
                retries.call(
                    "reading",
                    uri,
                    fs.cat_file,
                    path,
                    start=0,
                    end=self._limit + 1,
                    attempts=self._retries + 1,
                ),
            )
        except Exception as err:  # noqa: BLE001 - every failure becomes a bad-record message
            return self._failure(uri, err)

    async def _fetch_async(self, loop: Any, fs: Any, path: str, uri: str) -> bytes | str:
        import asyncio

        from vertexrt import retries

        semaphore = self._semaphores.get(loop)
        if semaphore is None:  # created on the loop it guards
            semaphore = self._semaphores[loop] = asyncio.Semaphore(self._concurrency)
        try:
            async with semaphore:
                data = await retries.call_async(
                    "reading",
                    uri,
                    lambda: fs._cat_file(path, start=0, end=self._limit + 1),
                    attempts=self._retries + 1,
                )
            return self._check(uri, data)
        except Exception as err:  # noqa: BLE001 - every failure becomes a bad-record message
            return self._failure(uri, err)

    def _check(self, uri: str, data: bytes) -> bytes | str:
        if len(data) > self._limit:
            return (
                f"{uri}: the object is larger than max_record_bytes={self._limit}; raise it if such "
                "objects are real"
            )
        return data

    def _failure(self, uri: str, err: Exception) -> str:
        """The bad-record message for a fetch that failed for good."""
        cause = err.__cause__ if isinstance(err, StorageError) else err
        if isinstance(cause, FileNotFoundError):
            return f"{uri}: referenced object not found (deleted or moved after the export?)"
        if isinstance(cause, PermissionError):
            return f"{uri}: permission denied ({cause}); grant the job's service account read access"
        if isinstance(err, VertexrtError):
            return f"{uri}: {err}"
        return f"{uri}: unreadable ({type(err).__name__}: {err})"

    def close(self) -> None:
        """Cancel what is still in flight and let the pool's threads go."""
        for future in self._held:
            future.cancel()
        self._pool.shutdown(wait=False, cancel_futures=True)


def _read_regular(path: str, size: int) -> bytes:
    """Up to ``size`` bytes of the regular file ``path``; anything else (a FIFO, a device, a socket) is
    refused before a read could block on it."""
    import os
    import stat

    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)  # opening a FIFO without a writer does not block
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise DataError(
                f"{path} is not a regular file (a FIFO, device or socket could block the reader forever); "
                "an export must name objects"
            )
        with os.fdopen(fd, "rb", closefd=False) as f:
            return f.read(min(size, info.st_size + 1))  # a read of ``size`` would allocate all of it
    finally:
        os.close(fd)

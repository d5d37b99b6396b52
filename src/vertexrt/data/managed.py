"""Vertex managed-dataset exports: JSONL lines that name objects (images, text, video) and their labels.

A TrainingPipeline over a managed image / text / video dataset hands the job JSONL files
(``AIP_DATA_FORMAT=jsonl``) whose lines reference the user's objects, e.g.
``{"imageGcsUri": "gs://b/x.jpg", "classificationAnnotation": {"displayName": "cat"}}``. These formats
read the lines, fetch the referenced objects in parallel (bounded concurrency, a few batches ahead of the
consumer, retried), and map display names to integer ids that are the same on every rank (the sorted
names of every line of every file, unless ``classes`` is given).

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
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, ClassVar

from vertexrt.data._io import MAX_RECORD_BYTES, compression_for
from vertexrt.data._lines import line_lists, locate
from vertexrt.data.formats import Errors, FileSource, Format
from vertexrt.errors import DataError, VertexrtError

if TYPE_CHECKING:
    from concurrent.futures import Future

CLASSIFICATION = ("classificationAnnotation", "classificationAnnotations")
BOXES = "boundingBoxAnnotations"
SEGMENTS = "timeSegmentAnnotations"
BATCH = 64
"""Lines per fetch batch (and per chunk handed to the cursor machinery)."""

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
        retries: attempts after a transient error (not for a missing object) before it is a bad record.
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
    ):
        if concurrency < 1 or ahead < 1 or retries < 0:
            raise DataError(
                f"{type(self).__name__}(concurrency={concurrency}, ahead={ahead}, retries={retries}): "
                "concurrency and ahead must be >= 1, retries >= 0"
            )
        self.classes = list(classes) if classes is not None else None
        self.fetch = bool(fetch)
        self.concurrency = int(concurrency)
        self.ahead = int(ahead)
        self.max_record_bytes = int(max_record_bytes)
        self.retries = int(retries)
        self.compression = compression

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
        """The URI of the object a parsed line references (None: nothing to fetch)."""
        for key in self.uri_keys:
            value = obj.get(key)
            if isinstance(value, str) and value:
                return value
        return None

    def read(
        self, source: FileSource, start: int, end: int | None, errors: Errors
    ) -> Iterator[tuple[int, list[Raw]]]:
        import orjson

        compression = compression_for(source.uri, self.compression)
        fetcher = _Fetcher(self.concurrency, self.max_record_bytes, self.retries) if self.fetch else None
        pending: deque[tuple[int, list[tuple[bytes, Any]], _Batch | None]] = deque()
        try:
            for pos, lines in line_lists(source.uri, compression, start, errors, limit=self.max_record_bytes):
                raws = list(filter(None, lines))
                for i in range(0, len(raws), BATCH):
                    parsed = []
                    for line in raws[i : i + BATCH]:
                        try:
                            obj = orjson.loads(line)
                        except orjson.JSONDecodeError:
                            obj = None
                        parsed.append((line, obj if isinstance(obj, dict) else None))
                    uris = [self.object_uri(obj) if obj is not None else None for _, obj in parsed]
                    batch = fetcher.submit(uris) if fetcher is not None else None
                    pending.append((pos, parsed, batch))  # a repeated position continues the read
                    while len(pending) > self.ahead:
                        yield _finish(pending.popleft())
            while pending:
                yield _finish(pending.popleft())
        finally:
            if fetcher is not None:
                fetcher.close()

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


def _finish(item: tuple[int, list[tuple[bytes, Any]], _Batch | None]) -> tuple[int, list[Raw]]:
    pos, parsed, batch = item
    payloads = batch.results() if batch is not None else [None] * len(parsed)
    return pos, [(line, obj, payload) for (line, obj), payload in zip(parsed, payloads, strict=True)]


class _Batch:
    """The fetches of one batch of lines: one future for all its Cloud Storage objects (a single coroutine
    on gcsfs's loop gathers them), a future per local / FUSE file, or the payload itself."""

    def __init__(self, slots: list[Any], remote: list[tuple[Future[list[bytes | str]], list[int]]]):
        self._slots = slots
        self._remote = remote

    def futures(self) -> list[Future[Any]]:
        from concurrent.futures import Future

        return [f for f, _ in self._remote] + [f for f in self._slots if isinstance(f, Future)]

    def results(self) -> list[bytes | str | None]:
        """Wait for every fetch; one payload per URI, in order."""
        from concurrent.futures import Future

        out = self._slots
        for future, indices in self._remote:
            for i, payload in zip(indices, future.result(), strict=True):
                out[i] = payload
        return [f.result() if isinstance(f, Future) else f for f in out]


class _Fetcher:
    """Reads whole objects, at most ``concurrency`` at once; each result is the bytes or an error message.

    Cloud Storage objects are fetched as coroutines on gcsfs's event loop (no thread per request), one
    ``gather`` per batch; local and FUSE files by a thread pool. Transient errors are retried with
    back-off; a missing object is not.
    """

    def __init__(self, concurrency: int, limit: int, retries: int):
        from concurrent.futures import ThreadPoolExecutor

        self._concurrency = concurrency
        self._pool = ThreadPoolExecutor(concurrency, thread_name_prefix="vertexrt-fetch")
        self._semaphores: dict[Any, Any] = {}  # event loop -> its asyncio.Semaphore(concurrency)
        self._limit = limit
        self._retries = retries
        self._futures: list[Future[Any]] = []
        self._buckets: dict[str, Any] = {}  # bucket -> gcsfs: one lookup per bucket, not per object

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

    def submit(self, uris: list[str | None]) -> _Batch:
        """Start fetching ``uris`` (None: nothing to fetch); the batch's ``results()`` waits for them."""
        import asyncio

        from fsspec.asyn import AsyncFileSystem

        slots: list[Any] = [None] * len(uris)
        remote: dict[Any, list[tuple[int, Any, str, str]]] = {}  # event loop -> (index, fs, path, uri)
        for i, uri in enumerate(uris):
            if not uri:
                continue
            try:
                fs, path = self._resolve(uri)
            except VertexrtError as err:  # a URI outside what paths accepts
                slots[i] = f"{uri}: {err}"
                continue
            if isinstance(fs, AsyncFileSystem) and fs.loop is not None:
                remote.setdefault(fs.loop, []).append((i, fs, path, uri))
            else:
                slots[i] = self._pool.submit(self._fetch, fs, path, uri)
        batch = _Batch(
            slots,
            [
                (asyncio.run_coroutine_threadsafe(self._fetch_all(loop, items), loop), [i for i, *_ in items])
                for loop, items in remote.items()
            ],
        )
        self._futures = [f for f in self._futures if not f.done()] + batch.futures()
        return batch

    async def _fetch_all(self, loop: Any, items: list[tuple[int, Any, str, str]]) -> list[bytes | str]:
        import asyncio

        semaphore = self._semaphores.get(loop)
        if semaphore is None:  # created on the loop it guards
            semaphore = self._semaphores[loop] = asyncio.Semaphore(self._concurrency)
        return await asyncio.gather(
            *(self._fetch_async(semaphore, fs, path, uri) for _, fs, path, uri in items)
        )

    def _fetch(self, fs: Any, path: str, uri: str) -> bytes | str:
        from vertexrt import paths

        local = paths.is_local_filesystem(fs)  # a local or FUSE file: read as such, not through fsspec
        for attempt in range(self._retries + 1):
            try:
                if local:
                    with open(path, "rb") as f:  # noqa: PTH123 - ``path`` is what paths.filesystem resolved
                        return self._check(uri, f.read(self._limit + 1))
                return self._check(uri, fs.cat_file(path, start=0, end=self._limit + 1))
            except Exception as err:  # noqa: BLE001 - classified below; every failure becomes a message
                message = self._failure(uri, err, attempt)
                if message is not None:
                    return message
            time.sleep(0.05 * 2**attempt)
        raise AssertionError("unreachable")

    async def _fetch_async(self, semaphore: Any, fs: Any, path: str, uri: str) -> bytes | str:
        import asyncio

        for attempt in range(self._retries + 1):
            try:
                async with semaphore:
                    data = await fs._cat_file(path, start=0, end=self._limit + 1)
                return self._check(uri, data)
            except Exception as err:  # noqa: BLE001 - classified below; every failure becomes a message
                message = self._failure(uri, err, attempt)
                if message is not None:
                    return message
            await asyncio.sleep(0.05 * 2**attempt)
        raise AssertionError("unreachable")

    def _check(self, uri: str, data: bytes) -> bytes | str:
        if len(data) > self._limit:
            return (
                f"{uri}: the object is larger than max_record_bytes={self._limit}; raise it if such "
                "objects are real"
            )
        return data

    def _failure(self, uri: str, err: Exception, attempt: int) -> str | None:
        """The bad-record message for ``err``, or None to retry it."""
        if isinstance(err, FileNotFoundError):
            return f"{uri}: referenced object not found (deleted or moved after the export?)"
        if isinstance(err, PermissionError):
            return f"{uri}: permission denied ({err}); grant the job's service account read access"
        if attempt >= self._retries:
            return f"{uri}: unreadable after {attempt + 1} attempts ({type(err).__name__}: {err})"
        return None

    def close(self) -> None:
        """Cancel what is still in flight and let the pool's threads go."""
        for future in self._futures:
            future.cancel()
        self._pool.shutdown(wait=False, cancel_futures=True)

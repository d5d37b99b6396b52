"""Binary files (images, audio, video): one record per object, labelled by its parent directory.

For the usual ``<class>/<name>.jpg`` layout each record is ``{"path": uri, "bytes": contents, "label": id}``
where ``id`` indexes the sorted class (directory) names of all the dataset's files, so every rank maps a
class to the same id whatever share of the files it reads.

Example:
    >>> ds = vertexrt.data.open_dataset("gs://b/images/*/*.jpg")        # detected from the extension
    >>> ds.format.classes
    ['cat', 'dog']
    >>> next(iter(ds))
    {'path': 'gs://b/images/dog/0042.jpg', 'bytes': b'\\xff\\xd8...', 'label': 1}
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any, ClassVar

from vertexrt.data._io import MAX_RECORD_BYTES, open_at
from vertexrt.data.formats import Errors, FileSource, Format
from vertexrt.errors import DataError

EXTENSIONS = frozenset(
    ("jpg", "jpeg", "png", "gif", "bmp", "webp", "tif", "tiff", "ico", "heic", "avif", "svg")
    + ("wav", "mp3", "flac", "ogg", "oga", "opus", "m4a", "aac", "aiff")
    + ("mp4", "m4v", "mov", "avi", "mkv", "webm", "mpg", "mpeg", "pdf", "npy")
)
"""Extensions read as :class:`Files` when no format is given."""


def parent_name(uri: str) -> str:
    """The name of the directory holding ``uri`` (its class in the ``<class>/<file>`` layout)."""
    parts = uri.rstrip("/").rsplit("/", 2)
    return parts[-2] if len(parts) > 1 else ""


class Files(Format):
    """Whole files as records ``{"path", "bytes", "label"}``.

    The shuffled file order of each epoch is already a full shuffle, so no record buffer is kept
    (``shuffle_buffer`` does not apply); exact resume continues with the next unread file.

    Args:
        classes: the class names, in label-id order; default the sorted parent directory names of
            all the files (the same on every rank). A file whose directory is not listed is a bad record.
        max_record_bytes: a larger file is a bad record, refused before it is read (default 256 MiB).
    """

    name = "files"
    one_record_per_source: ClassVar[bool] = True

    def __init__(self, classes: Sequence[str] | None = None, max_record_bytes: int = MAX_RECORD_BYTES):
        self.classes = list(classes) if classes is not None else None
        self.max_record_bytes = int(max_record_bytes)

    def for_sources(self, sources: Sequence[Any]) -> Files:
        if self.classes is not None:
            return self
        return Files(sorted({parent_name(s.uri) for s in sources}), self.max_record_bytes)

    def read(
        self, source: FileSource, start: int, end: int | None, errors: Errors
    ) -> Iterator[tuple[int, list[tuple[str, bytes]]]]:
        if start > 0:
            return
        if source.size > self.max_record_bytes:
            errors.bad(
                f"{source.uri}: the file has {source.size} bytes, more than max_record_bytes="
                f"{self.max_record_bytes}; raise Files(max_record_bytes=...) if such files are real"
            )
            return
        try:  # a Cloud Storage object is read under the storage deadline (a stalled one is a bad record)
            f = open_at(source.uri, "", 0, size=source.size)
            try:
                data = f.read(self.max_record_bytes + 1)
            finally:
                f.close()
        except DataError as err:  # not found, permission denied, no answer in time
            errors.bad(str(err))
            return
        if len(data) > self.max_record_bytes:
            errors.bad(
                f"{source.uri}: the file grew past max_record_bytes={self.max_record_bytes} while read"
            )
            return
        yield 0, [(source.uri, data)]

    def count(self, source: FileSource, errors: Errors) -> int:
        return 1

    def decoder(self) -> Callable[[tuple[str, bytes]], dict[str, Any]]:
        ids = {name: i for i, name in enumerate(self.classes or [])}
        classes = self.classes

        def decode(raw: tuple[str, bytes]) -> dict[str, Any]:
            uri, data = raw
            label = ids.get(parent_name(uri))
            if label is None:
                raise DataError(
                    f"its directory {parent_name(uri)!r} is not one of the classes {classes}; pass "
                    "Files(classes=[...]) naming it, or leave classes unset to use every directory"
                )
            return {"path": uri, "bytes": data, "label": label}

        return decode

    def describe(self, raw: tuple[str, bytes], origins: list[tuple[Any, int]], error: Exception) -> str:
        return f"{raw[0]}: {error}"

"""The grammar of ``gs://`` URIs and ``/gcs/`` paths: parse, validate, redact. Strings only, no I/O.

It sits above :mod:`vertexrt.env` (which validates ``AIP_*`` locations with it) and below
:mod:`vertexrt.paths` (which turns a valid URI into a location), so neither imports the other.

Example:
    >>> from vertexrt import uris
    >>> uris.split_gcs("gs://my-bucket/runs/1")
    ('my-bucket', 'runs/1')
    >>> uris.redact("gs://user:pw@my-bucket/x")
    'gs://***@my-bucket/x'
"""

from __future__ import annotations

from vertexrt.errors import PathError

GCS_SCHEME = "gs://"
FUSE_PREFIX = "/gcs/"

_BUCKET_EDGE = frozenset("abcdefghijklmnopqrstuvwxyz0123456789")
_BUCKET_CHARS = _BUCKET_EDGE | frozenset("._-")
_MAX_OBJECT_BYTES = 1024
#: Query parameters that carry a credential (signed URLs, tokens, API keys); compared lowercase.
_SECRET_PARAMS = frozenset(
    {
        "x-goog-signature",
        "x-goog-credential",
        "x-amz-signature",
        "x-amz-credential",
        "x-amz-security-token",
        "signature",
        "sig",
        "token",
        "access_token",
        "key",
        "api_key",
        "password",
    }
)


def is_gcs(uri: str) -> bool:
    """True for a ``gs://`` URI."""
    return str(uri).startswith(GCS_SCHEME)


def is_fuse(path: str) -> bool:
    """True for a path on the Cloud Storage FUSE mount (``/gcs/BUCKET/...``)."""
    text = str(path)
    return text.startswith(FUSE_PREFIX) or text == FUSE_PREFIX.rstrip("/")


def check_text(text: str) -> None:
    """Refuse what no location may contain: a NUL byte, or a mistyped ``gs://`` scheme.

    Raises:
        PathError: ``text`` contains ``\\0``, or starts with ``gs:`` (any case) but not ``gs://``.
    """
    if "\x00" in text:
        raise PathError(f"{redact(text)!r} contains a NUL byte: no path or object name can")
    if text[:3].lower() == "gs:" and not text.startswith(GCS_SCHEME):
        raise PathError(
            f"{redact(text)!r} is a malformed gs:// URI: write gs://BUCKET/object (lowercase, two slashes)"
        )


def split_gcs(uri: str) -> tuple[str, str]:
    """``gs://bucket/a/b`` -> ``("bucket", "a/b")``; the object part may be empty.

    Raises:
        PathError: not a gs:// URI, a bucket name Cloud Storage would refuse, or an object name that
            would leave its bucket's directory (``.``/``..``/empty segment, NUL byte).
    """
    text = str(uri)
    check_text(text)
    if not is_gcs(text):
        raise PathError(f"{redact(text)!r} is not a gs:// URI")
    bucket, _, obj = text[len(GCS_SCHEME) :].partition("/")
    _check_bucket(bucket, text)
    _check_object(obj, text)
    return bucket, obj


def split_fuse(path: str) -> tuple[str, str]:
    """``/gcs/bucket/a/b`` -> ``("bucket", "a/b")``, validated like :func:`split_gcs`."""
    text = str(path)
    check_text(text)
    if not is_fuse(text):
        raise PathError(f"{redact(text)!r} is not a /gcs/ path")
    bucket, _, obj = text[len(FUSE_PREFIX) :].partition("/")
    if not bucket:
        raise PathError(f"{text!r} has no bucket: expected /gcs/BUCKET/object")
    _check_bucket(bucket, text)
    _check_object(obj, text)
    return bucket, obj


def split(uri: str) -> tuple[str, str]:
    """Bucket and object of a ``gs://`` URI or a ``/gcs/`` path."""
    return split_gcs(uri) if is_gcs(uri) else split_fuse(uri)


def redact(uri: str) -> str:
    """``uri`` with embedded credentials masked: userinfo (``gs://user:pw@b``) and secret query values.

    Example:
        >>> redact("https://h/o?X-Goog-Signature=abc&alt=media")
        'https://h/o?X-Goog-Signature=***&alt=media'
    """
    text = str(uri)
    scheme, sep, rest = text.partition("://")
    if sep and "/" not in scheme:
        authority, slash, tail = rest.partition("/")
        if "@" in authority:
            rest = "***@" + authority.rpartition("@")[2] + slash + tail
        text = scheme + sep + rest
    head, question, query = text.partition("?")
    if not question:
        return text
    fragment = ""
    if "#" in query:
        query, _, fragment = query.partition("#")
        fragment = "#" + fragment
    masked = []
    for pair in query.split("&"):
        name, equals, _ = pair.partition("=")
        masked.append(f"{name}=***" if equals and name.lower() in _SECRET_PARAMS else pair)
    return f"{head}?{'&'.join(masked)}{fragment}"


def _check_bucket(bucket: str, uri: str) -> None:
    """Cloud Storage's bucket naming rules."""
    if not bucket:
        raise PathError(f"{redact(uri)!r} has no bucket name: expected gs://BUCKET/object")
    problem = None
    if "@" in bucket:
        bucket = "***@" + bucket.rpartition("@")[2]
        problem = (
            "credentials cannot be embedded in a gs:// URI (the job's service account is used); remove them"
        )
    elif bucket != bucket.lower():
        problem = "bucket names must be lowercase"
    elif (
        len(bucket) < 3
        or not set(bucket) <= _BUCKET_CHARS
        or bucket[0] not in _BUCKET_EDGE
        or bucket[-1] not in _BUCKET_EDGE
    ):
        problem = (
            "bucket names are 3-63 characters of a-z, 0-9, '-', '_' and '.', starting and ending with a "
            "letter or digit"
        )
    elif ".." in bucket or ".-" in bucket or "-." in bucket:
        problem = "bucket names cannot contain '..', '.-' or '-.'"
    elif len(bucket) > 222 or any(len(part) > 63 for part in bucket.split(".")):
        problem = "bucket names are at most 63 characters (222 with dots, 63 per dot-separated part)"
    elif len(bucket.split(".")) == 4 and all(part.isdigit() for part in bucket.split(".")):
        problem = "bucket names cannot be IP addresses"
    elif bucket.startswith("goog") or "google" in bucket or "g00gle" in bucket:
        problem = "bucket names cannot start with 'goog' or contain 'google'"
    if problem:
        shown = bucket if len(bucket) <= 80 else bucket[:80] + "..."
        raise PathError(f"invalid bucket name {shown!r} in {redact(uri)[:200]!r}: {problem}")


def _check_object(obj: str, uri: str) -> None:
    """Object names that stay inside their bucket's directory, on the API and on the mount alike."""
    if not obj:
        return
    shown = redact(uri) if len(uri) <= 200 else redact(uri)[:200] + "..."
    if len(obj.encode("utf-8", "surrogatepass")) > _MAX_OBJECT_BYTES:
        raise PathError(f"{shown!r}: object names are at most {_MAX_OBJECT_BYTES} bytes of UTF-8")
    segments = obj.split("/")
    if any(segment in ("..", ".") for segment in segments):
        raise PathError(
            f"{shown!r} has a '.' or '..' segment: object paths must not step out of their prefix"
        )
    if "" in segments[:-1]:
        raise PathError(
            f"{shown!r} has an empty segment ('//'): on the /gcs/ mount it would name a path outside the "
            "bucket; remove the doubled slash"
        )
    if "\r" in obj or "\n" in obj:
        raise PathError(f"{shown!r}: object names cannot contain carriage returns or line feeds")

"""Deadlines for object-store calls: each one finishes, or fails in time with an error naming what and where.

A call gets ``VERTEXRT_STORAGE_TIMEOUT`` seconds to move data (default 120) and
``VERTEXRT_STORAGE_LIST_TIMEOUT`` seconds to list, check or delete (default 30, or the data timeout when that
is shorter). Inside the deadline, transient failures (HTTP 408/429/5xx, dropped connections) are retried with
back-off; gcsfs's own retries run inside it too and are cut off when it passes (fsspec cancels the call).
What is left is raised as :class:`StorageError`, a ``CheckpointError``.

Example:
    >>> data = call("reading", "gs://b/run/step_1/manifest.json", fs.cat_file, "b/run/step_1/manifest.json")
"""

from __future__ import annotations

import logging
import math
import os
import random
import time
from collections.abc import Callable
from typing import Any, Literal, TypeVar

from vertexrt.errors import ConfigError, StorageError, VertexrtError

log = logging.getLogger(__name__)

T = TypeVar("T")
Kind = Literal["data", "list"]

VARIABLES: dict[Kind, str] = {"data": "VERTEXRT_STORAGE_TIMEOUT", "list": "VERTEXRT_STORAGE_LIST_TIMEOUT"}
_DEFAULTS: dict[Kind, float] = {"data": 120.0, "list": 30.0}
_MAX_SECONDS = 86400.0
_FIRST_PAUSE, _MAX_PAUSE = 0.5, 8.0
#: Not an outage: the caller decides what these mean (a missing step, a lost create-only race, a short file).
_ANSWERS = (FileNotFoundError, FileExistsError, EOFError, NotImplementedError, VertexrtError)


def storage_timeout(kind: Kind) -> float:
    """Seconds one storage call of this kind may take (read from the environment on every call).

    Example:
        >>> os.environ["VERTEXRT_STORAGE_TIMEOUT"] = "20"
        >>> storage_timeout("data"), storage_timeout("list")
        (20.0, 20.0)
    """
    data = _seconds(VARIABLES["data"], _DEFAULTS["data"])
    return data if kind == "data" else _seconds(VARIABLES["list"], min(_DEFAULTS["list"], data))


def call(operation: str, uri: str, fn: Callable[..., T], *args: Any, kind: Kind = "data", **kwargs: Any) -> T:
    """``fn(*args, timeout=<seconds left>, **kwargs)`` (an fsspec async filesystem's sync method), retried.

    Raises:
        StorageError: the deadline passed, a transient failure outlasted it, or storage refused the call.
    """
    limit = storage_timeout(kind)
    start = time.monotonic()
    end = start + limit
    attempt = 0
    while True:
        try:
            return fn(*args, timeout=max(end - time.monotonic(), 0.001), **kwargs)
        except _ANSWERS:
            raise
        except Exception as exc:
            attempt += 1
            pause = min(_MAX_PAUSE, _FIRST_PAUSE * 2 ** (attempt - 1)) * random.uniform(0.5, 1.0)
            timed_out = _is_deadline(exc)
            if timed_out or not _transient(exc) or time.monotonic() + pause >= end:
                raise StorageError(
                    _message(operation, uri, kind, limit, attempt, exc, timed_out), operation, uri
                )
            log.warning(
                "%s %s failed (attempt %d), retrying in %.1f s: %r", operation, uri, attempt, pause, exc
            )
            time.sleep(pause)


def _message(
    operation: str, uri: str, kind: Kind, limit: float, attempts: int, exc: BaseException, timed_out: bool
) -> str:
    variable = VARIABLES[kind]
    if timed_out:
        what = f"got no usable answer within {limit:g} s"
    else:
        what = f"failed after {attempts} attempt(s): {type(exc).__name__}: {exc}"
    return (
        f"Cloud Storage {what} while {operation} {uri}; check the network and the bucket's availability and "
        f"permissions, or allow more time with {variable} (seconds)"
    )


def _is_deadline(exc: BaseException) -> bool:
    from fsspec.exceptions import FSTimeoutError

    return isinstance(exc, FSTimeoutError)


def _transient(exc: BaseException) -> bool:
    """Worth another try: what gcsfs retries (HTTP 408/429/5xx, client errors) and dropped connections."""
    if isinstance(exc, (ConnectionError, TimeoutError)):
        return True
    try:
        from gcsfs.retry import is_retriable
    except ImportError:
        return False
    return bool(is_retriable(exc))


def _seconds(name: str, default: float) -> float:
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not 0 < value <= _MAX_SECONDS:
        raise ConfigError(
            f"{name}={raw!r}: expected a number of seconds > 0 and <= {_MAX_SECONDS:g} "
            f"(e.g. {name}={_DEFAULTS['data']:g}), or unset it for the default"
        )
    return value

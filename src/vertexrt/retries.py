"""The one retry and deadline policy for storage calls (checkpoints, data files, managed-dataset objects).

A call gets ``VERTEXRT_STORAGE_TIMEOUT`` seconds to move data (default 120) and
``VERTEXRT_STORAGE_LIST_TIMEOUT`` seconds to list, check or delete (default 30, or the data timeout when that
is shorter). Inside the deadline, transient failures (HTTP 408/429/5xx, dropped connections) are retried with
exponential back-off (``google.api_core.retry``); gcsfs's own retries run inside it too and are cut off when
it passes (fsspec cancels the call). What is left is raised as :class:`~vertexrt.errors.StorageError`
naming the operation and the URI.

Example:
    >>> data = call("reading", "gs://b/run/step_1/manifest.json", fs.cat_file, "b/run/step_1/manifest.json")
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Awaitable, Callable
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
ANSWERS = (FileNotFoundError, FileExistsError, EOFError, NotImplementedError, VertexrtError)


def storage_timeout(kind: Kind) -> float:
    """Seconds one storage call of this kind may take (read from the environment on every call).

    Example:
        >>> os.environ["VERTEXRT_STORAGE_TIMEOUT"] = "20"
        >>> storage_timeout("data"), storage_timeout("list")
        (20.0, 20.0)
    """
    data = _seconds(VARIABLES["data"], _DEFAULTS["data"])
    return data if kind == "data" else _seconds(VARIABLES["list"], min(_DEFAULTS["list"], data))


def call(
    operation: str,
    uri: str,
    fn: Callable[..., T],
    *args: Any,
    kind: Kind = "data",
    attempts: int | None = None,
    **kwargs: Any,
) -> T:
    """``fn(*args, timeout=<seconds left>, **kwargs)`` (an fsspec async filesystem's sync method), retried
    within the deadline (and at most ``attempts`` times when given).

    Raises:
        StorageError: the deadline passed, a transient failure outlasted it, or storage refused the call.
        FileNotFoundError, VertexrtError, ...: answers (:data:`ANSWERS`), raised as they are.
    """
    from google.api_core.retry import exponential_sleep_generator, retry_target

    limit = storage_timeout(kind)
    end = time.monotonic() + limit

    def attempt() -> T:
        return fn(*args, timeout=max(end - time.monotonic(), 0.001), **kwargs)

    return retry_target(  # type: ignore[no-any-return]
        attempt,
        _predicate(attempts),
        exponential_sleep_generator(_FIRST_PAUSE, _MAX_PAUSE),
        timeout=limit,
        on_error=lambda exc: log.warning("%s %s failed, retrying: %r", operation, uri, exc),
        exception_factory=_factory(operation, uri, kind, limit),
    )


async def call_async(
    operation: str,
    uri: str,
    fn: Callable[[], Awaitable[T]],
    *,
    kind: Kind = "data",
    attempts: int | None = None,
) -> T:
    """``await fn()`` (a coroutine factory on an event loop), each attempt cut off at the deadline, retried
    as :func:`call` does.

    Raises:
        StorageError: as :func:`call`.
    """
    import asyncio

    from google.api_core.retry import exponential_sleep_generator
    from google.api_core.retry_async import retry_target

    limit = storage_timeout(kind)
    end = time.monotonic() + limit

    async def attempt() -> T:
        try:
            return await asyncio.wait_for(fn(), max(end - time.monotonic(), 0.001))
        except asyncio.TimeoutError as exc:
            raise _Deadline() from exc

    return await retry_target(  # type: ignore[no-any-return]
        attempt,
        _predicate(attempts),
        exponential_sleep_generator(_FIRST_PAUSE, _MAX_PAUSE),
        timeout=limit,
        on_error=lambda exc: log.warning("%s %s failed, retrying: %r", operation, uri, exc),
        exception_factory=_factory(operation, uri, kind, limit),
    )


def transient(exc: BaseException) -> bool:
    """Worth another try: what gcsfs retries (HTTP 408/429/5xx, client errors) and dropped connections."""
    if isinstance(exc, ANSWERS) or _is_deadline(exc):
        return False
    if isinstance(exc, (ConnectionError, TimeoutError)):
        return True
    try:
        from gcsfs.retry import is_retriable
    except ImportError:
        return False
    return bool(is_retriable(exc))


class _Deadline(Exception):
    """An attempt of :func:`call_async` was cut off at the deadline."""


def _predicate(attempts: int | None) -> Callable[[Exception], bool]:
    seen = [0]

    def retry(exc: Exception) -> bool:
        seen[0] += 1
        return transient(exc) and (attempts is None or seen[0] < attempts)

    return retry


def _factory(
    operation: str, uri: str, kind: Kind, limit: float
) -> Callable[[list[Exception], Any, float | None], tuple[Exception, Exception | None]]:
    def build(
        errors: list[Exception], reason: Any, timeout: float | None
    ) -> tuple[Exception, Exception | None]:
        last = errors[-1]
        if isinstance(last, ANSWERS):
            return last, None  # raised as it is (``raise last from None`` keeps its own traceback)
        timed_out = _is_deadline(last)
        return StorageError(
            _message(operation, uri, kind, limit, len(errors), last, timed_out), operation, uri
        ), last

    return build


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
    if isinstance(exc, _Deadline):
        return True
    from fsspec.exceptions import FSTimeoutError

    return isinstance(exc, FSTimeoutError)


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

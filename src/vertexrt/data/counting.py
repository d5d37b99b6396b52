"""Counting the records of data files once per job, not once per rank: the files (or file pieces) are
shared out between the ranks by bytes, each rank counts its share, and the counts are all-gathered on the
CPU side group; the counts are kept in a small cache file keyed by the data's fingerprint (file names,
sizes, versions, the format), so a restarted job does not count again.

Where the cache lives (:func:`cache_dir`): ``VERTEXRT_COUNT_CACHE`` when set (a directory or ``gs://``
prefix; ``off`` turns the cache off); else beside the job's checkpoints, ``$AIP_CHECKPOINT_DIR/
vertexrt-data-counts``: it belongs to the job, and outlives the VM, so a Vertex restart on a fresh VM (or
``local-run``'s restarts) finds it. Without either there is no cache (nothing is written outside the job's
own directories; counting again on local disk is cheap). With several ranks only rank 0 reads and writes it;
the others receive its counts by a broadcast.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Callable, Sequence
from typing import Any

from vertexrt.data.formats.base import FileSource
from vertexrt.errors import DataError

logger = logging.getLogger(__name__)

Key = tuple[int, int, "int | None"]
"""A counted unit: ``(file index, start, end)``; ``end`` None for a whole file."""

CACHE_VERSION = 1
MAX_CACHE_BYTES = 64 << 20
"""Largest count cache read (a bigger one is damage, not counts: it is ignored)."""


def cache_dir() -> str | None:
    """Where count caches live (see the module docstring), or None: no cache."""
    explicit = os.environ.get("VERTEXRT_COUNT_CACHE")
    if explicit is not None:
        return None if explicit.strip().lower() in ("", "off", "0", "none") else explicit
    checkpoints = os.environ.get("AIP_CHECKPOINT_DIR")
    if not checkpoints:
        return None
    from vertexrt import paths

    return paths.join(checkpoints, "vertexrt-data-counts")


def data_key(files: Sequence[FileSource], fmt: Any, on_error: str, columnar: bool) -> str:
    """The fingerprint counts are valid for: every file's name, size and version (the Cloud Storage
    generation, or the local modification time), the format with its options, the error policy."""
    blob = json.dumps(
        [CACHE_VERSION, repr(fmt), on_error, columnar, [(f.uri, f.size, f.version) for f in files]],
        default=str,
    )
    return hashlib.sha1(blob.encode()).hexdigest()


class CountCache:
    """The count cache file of one dataset (``key``: :func:`data_key`) in ``directory``."""

    def __init__(self, directory: str, key: str):
        from vertexrt import paths

        self.key = key
        self.uri = paths.join(directory, f"{key[:32]}.json")

    def load(self) -> dict[Key, int]:
        """The cached counts; none when there is no cache, or it is damaged or of other data (logged)."""
        from vertexrt import paths, retries

        try:
            if paths.storage_kind(self.uri) == "local":
                with open(self.uri, "rb") as f:
                    blob = f.read(MAX_CACHE_BYTES + 1)
            else:  # one request: no metadata asked first
                fs, path = paths.filesystem(self.uri)
                blob = retries.call("reading", self.uri, fs.cat_file, path, start=0, end=MAX_CACHE_BYTES + 1)
        except FileNotFoundError:
            return {}
        except Exception as err:  # noqa: BLE001 - a cache that cannot be read is counted again
            logger.warning("record count cache %s unreadable (%s): counting again", self.uri, err)
            return {}
        counts = _parsed(blob, self.key) if len(blob) <= MAX_CACHE_BYTES else None
        if counts is None:
            logger.warning("record count cache %s is damaged or of other data: counting again", self.uri)
            return {}
        return counts

    def store(self, counts: dict[Key, int]) -> None:
        """Write ``counts`` (a failure is logged: the next start counts again)."""
        from vertexrt import paths, retries

        blob = json.dumps(
            {
                "version": CACHE_VERSION,
                "key": self.key,
                "counts": [[s, a, b, n] for (s, a, b), n in sorted(counts.items(), key=_order)],
            }
        ).encode()
        try:
            if paths.storage_kind(self.uri) == "local":  # a reader never sees half a file
                os.makedirs(os.path.dirname(self.uri), exist_ok=True)
                partial = f"{self.uri}.{os.getpid()}.tmp"
                with open(partial, "wb") as f:
                    f.write(blob)
                os.replace(partial, self.uri)
            else:  # one object upload: whole or absent
                fs, path = paths.filesystem(self.uri)
                retries.call("writing", self.uri, fs.pipe_file, path, blob)
        except Exception as err:  # noqa: BLE001 - the counts are known; only the next start pays
            logger.warning("could not write the record count cache %s (%s)", self.uri, err)


def _order(item: tuple[Key, int]) -> tuple[int, int, int]:
    (source, start, end), _ = item
    return source, start, -1 if end is None else end


def _parsed(blob: bytes, key: str) -> dict[Key, int] | None:
    try:
        data = json.loads(blob)
    except ValueError:
        return None
    if not isinstance(data, dict) or data.get("version") != CACHE_VERSION or data.get("key") != key:
        return None
    rows = data.get("counts")
    if not isinstance(rows, list):
        return None
    out: dict[Key, int] = {}
    for row in rows:
        if (
            not isinstance(row, list)
            or len(row) != 4
            or not all(type(v) is int and v >= 0 for v in (row[0], row[1], row[3]))
            or not (row[2] is None or type(row[2]) is int and row[2] > row[1])
        ):
            return None
        out[(row[0], row[1], row[2])] = row[3]
    return out


def share_out(keys: Sequence[Key], sizes: Sequence[int], world_size: int) -> list[list[Key]]:
    """``keys`` (of ``sizes`` bytes) shared out between ``world_size`` ranks so that each reads about
    ``1/world_size`` of the bytes: largest first, each to the rank with the fewest bytes so far.

    Example:
        >>> share_out([(0, 0, None), (1, 0, None), (2, 0, None)], [30, 20, 10], 2)
        [[(0, 0, None)], [(1, 0, None), (2, 0, None)]]
    """
    loads = [0] * world_size
    shares: list[list[Key]] = [[] for _ in range(world_size)]
    for i in sorted(range(len(keys)), key=lambda i: (-sizes[i], i)):
        rank = min(range(world_size), key=lambda r: (loads[r], r))
        shares[rank].append(keys[i])
        loads[rank] += sizes[i]
    return shares


def count_together(
    keys: Sequence[Key],
    sizes: Sequence[int],
    count: Callable[[Key], int],
    dist: Any,
    cache: CountCache | None,
    describe: Callable[[Key], str],
) -> dict[Key, int]:
    """The counts of ``keys``, counted once across the ranks of ``dist`` (every rank calls it with the
    same keys): rank 0 reads the cache and broadcasts it, each rank counts its :func:`share_out` of the
    rest, the counts are all-gathered, and rank 0 writes the cache when something was counted.

    Raises:
        DataError: a count failed on some rank: every rank raises the same error, naming the file and
            the rank (no rank is left waiting in a collective).
    """
    from vertexrt.distributed.collectives import all_gather, broadcast

    rank, world = dist.get_rank(), dist.get_world_size()
    cached = broadcast(cache.load() if cache is not None and rank == 0 else {}, dist)
    todo = [(k, n) for k, n in zip(keys, sizes, strict=True) if k not in cached]
    mine: dict[Key, int] = {}
    failure = None
    for key in share_out([k for k, _ in todo], [n for _, n in todo], world)[rank]:
        try:
            mine[key] = count(key)
        except Exception as err:  # noqa: BLE001 - every rank must reach the gather to learn of it
            failure = f"{describe(key)}: counting its records (for equalize) failed on rank {rank}: {err}"
            break
    parts = all_gather((failure, mine), dist)
    for failed, _ in parts:
        if failed:
            raise DataError(f"{failed}; fix the cause, then restart every rank")
    counted = {k: n for _, part in parts for k, n in part.items()}
    if counted and cache is not None and rank == 0:
        cache.store({**cached, **counted})
    return {**cached, **counted}


def count_alone(
    keys: Sequence[Key], count: Callable[[Key], int], cache: CountCache | None, write: bool
) -> dict[Key, int]:
    """The counts of ``keys`` counted in this process (those the cache holds are read from it); the cache
    is written when something was counted and ``write``."""
    cached = cache.load() if cache is not None else {}
    counted = {key: count(key) for key in keys if key not in cached}
    if counted and cache is not None and write:
        cache.store({**cached, **counted})
    return {**cached, **counted}

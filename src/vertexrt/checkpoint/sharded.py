"""The sharded commit: every rank writes its shard and a small shard record; rank 0 commits once all arrived.

Records are ``shard.<k>.<token>.json`` in the step's write directory (the token is shared by all ranks for
one save); a rank that fails leaves ``shard.<k>.<token>.failed`` so rank 0 stops waiting at once.

Example:
    >>> publish(store, write_dir, token, shard=1, body=body)       # every rank
    >>> bodies = gather(store, write_dir, token, world_size=2, timeout=1800)   # rank 0
"""

from __future__ import annotations

import time
from typing import Any

from vertexrt.checkpoint.manifest import dumps
from vertexrt.checkpoint.storage import Store
from vertexrt.errors import CheckpointError


def publish(store: Store, write_dir: str, token: str, shard: int, body: dict[str, Any]) -> None:
    """Record that ``shard``'s files are written (``body``: prefix, files, tree)."""
    store.write_atomic(store.join(write_dir, f"shard.{shard:05d}.{token}.json"), dumps(body))


def fail(store: Store, write_dir: str, token: str, shard: int, error: BaseException) -> None:
    """Tell rank 0 that ``shard`` will not arrive."""
    store.write_atomic(store.join(write_dir, f"shard.{shard:05d}.{token}.failed"), repr(error).encode())


def gather(store: Store, write_dir: str, token: str, *, world_size: int, timeout: float) -> list[Any]:
    """Every rank's shard body, once all ``world_size`` records of this save are in ``write_dir``."""
    import orjson

    deadline = time.monotonic() + timeout
    delay = 0.01
    while True:
        names = [e.name for e in store.listdir(write_dir) if token in e.name]
        failed = [n for n in names if n.endswith(".failed")]
        if failed:
            raise CheckpointError(f"a rank failed to write its shard in {write_dir}: {failed}")
        done = sorted(n for n in names if n.startswith("shard.") and n.endswith(".json"))
        if len(done) >= world_size:
            return [orjson.loads(store.read_bytes(store.join(write_dir, n))) for n in done]
        if time.monotonic() > deadline:
            raise CheckpointError(
                f"only {len(done)} of {world_size} shards arrived in {write_dir} within {timeout:.0f} s: "
                "did every rank call save(..., shard=rank)?"
            )
        time.sleep(delay)
        delay = min(delay * 2, 0.5)

"""Bytes into any storage root the tests use (a local dir, gs:// on the test server), for fixtures and
tests that plant or damage files."""

from __future__ import annotations

from vertexrt import paths


def write_bytes(uri: str, data: bytes) -> str:
    """Write ``data`` to ``uri`` (replacing it) and drop the filesystem's listing cache, so the next listing
    sees it; returns ``uri``."""
    with paths.open(uri, "wb") as f:
        f.write(data)
    paths.filesystem(uri)[0].invalidate_cache()
    return uri

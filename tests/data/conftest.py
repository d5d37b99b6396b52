"""Fixtures for the data tests: writers that put files under any storage root (local dir or gs://)."""

from __future__ import annotations

import gzip
import json
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import pytest
from storage_bytes import write_bytes

from vertexrt import paths
from vertexrt.data import open_dataset

SIZES_7 = [5, 50, 1, 0, 33, 120, 7]  # uneven, one empty: 216 records


def read_all(uri: str, **kw: Any) -> list[Any]:
    """Every record of ``uri`` in order, as one reader of one (no shuffle) unless ``kw`` says otherwise;
    ``kw``: ``open_dataset``'s."""
    return list(open_dataset(uri, **{"shuffle": False, "rank": 0, "world_size": 1, **kw}))


def assert_resumes_exactly(uri: str, stops: Iterable[int]) -> None:
    """Stopping after each of ``stops`` records, saving the state and resuming a new reader from it gives
    exactly the records of one uninterrupted read."""
    full = read_all(uri)
    for stop in stops:
        ds = open_dataset(uri, shuffle=False, rank=0, world_size=1)
        it = iter(ds)
        head = [next(it) for _ in range(stop)]
        state = ds.state_dict()
        del it
        resumed = open_dataset(uri, shuffle=False, rank=0, world_size=1)
        resumed.load_state_dict(state)
        assert head + list(resumed) == full, f"stop={stop}"


def jsonl_bytes(records: Iterable[Any]) -> bytes:
    return b"".join(json.dumps(r).encode() + b"\n" for r in records)


@pytest.fixture
def write_jsonl() -> Callable[..., str]:
    """``write_jsonl(uri, records, gz=False)``."""

    def write(uri: str, records: Iterable[Any], gz: bool = False) -> str:
        data = jsonl_bytes(records)
        return write_bytes(uri, gzip.compress(data) if gz else data)

    return write


@pytest.fixture
def id_files(write_jsonl: Callable[..., str]) -> Callable[..., list[str]]:
    """``id_files(root, sizes)``: JSONL files ``part-i.jsonl`` of ``{"id": n}`` with consecutive ids."""

    def make(root: str, sizes: Sequence[int] = SIZES_7, prefix: str = "part") -> list[str]:
        uris = []
        next_id = 0
        for index, size in enumerate(sizes):
            uri = paths.join(root, f"{prefix}-{index:02d}.jsonl")
            write_jsonl(uri, [{"id": next_id + i} for i in range(size)])
            next_id += size
            uris.append(uri)
        return uris

    return make

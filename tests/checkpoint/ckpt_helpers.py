"""Shared helpers for checkpoint tests and their subprocesses: deterministic states, byte surgery on files."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import numpy as np

from vertexrt import paths

HERE = os.path.dirname(os.path.abspath(__file__))


def make_state(step: int, sizes: tuple[int, ...] = (150_000, 30_000, 260_000)) -> dict:
    """A state that is a pure function of ``step`` (numpy + Python values), for bit-exact checks."""
    rng = np.random.default_rng(step)
    return {
        "step": step,
        "arrays": [rng.integers(0, 2**31, size=n, dtype=np.int64) for n in sizes],
        "meta": {"name": f"run-{step}", "lr": 0.1 / (step + 1), "flags": (True, None)},
        "blob": rng.bytes(1000),
    }


def assert_state_equal(got: dict, want: dict) -> None:
    assert got["step"] == want["step"]
    assert got["meta"] == want["meta"]
    assert got["blob"] == want["blob"]
    assert len(got["arrays"]) == len(want["arrays"])
    for a, b in zip(got["arrays"], want["arrays"], strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert np.array_equal(a, b)


def list_files(root: str) -> list[str]:
    """Every file under ``root`` (local or gs://), as paths relative to ``root``."""
    fs, path = paths.filesystem(root)
    fs.invalidate_cache()
    found = fs.find(path)
    return sorted(os.path.relpath(f, path) if not paths.is_gcs(root) else f[len(path) + 1 :] for f in found)


def read_bytes(uri: str) -> bytes:
    fs, path = paths.filesystem(uri)
    fs.invalidate_cache()
    return bytes(fs.cat_file(path))


def write_bytes(uri: str, data: bytes) -> str:
    """:func:`storage_bytes.write_bytes`."""
    import storage_bytes  # here: worker processes import this module with only tests/checkpoint on their path

    return storage_bytes.write_bytes(uri, data)


def remove(uri: str) -> None:
    fs, path = paths.filesystem(uri)
    fs.rm(path)
    fs.invalidate_cache()


def disk_full_scenario(root: str) -> str:
    """Save a small step, then one that does not fit; return what happened (checked by the caller)."""
    from vertexrt.checkpoint import CheckpointManager
    from vertexrt.errors import CheckpointError

    small = make_state(1, sizes=(20_000,))
    big = make_state(2, sizes=(2_000_000,))  # 16 MB: more than the location holds
    with CheckpointManager(root) as mgr:
        mgr.save(1, small)
        mgr.wait()
        mgr.save(2, big)
        try:
            mgr.wait()
            return "no error"
        except CheckpointError as exc:
            message = str(exc)
    leftovers = [name for name in os.listdir(root) if name.startswith(".tmp")]
    with CheckpointManager(root) as mgr:
        steps = mgr.all_steps()
        assert_state_equal(mgr.restore(), small)
        mgr.save(3, make_state(3, sizes=(20_000,)))  # space was given back
        mgr.wait()
        after = mgr.all_steps()
    return f"error={message!r} steps={steps} leftovers={leftovers} after={after}"


def run_ranks(script: str, world: int, argv: Callable[[int, int], list[str]]) -> list[tuple[int, str, str]]:
    """:func:`jobs.run_ranks` of ``script``, a worker beside this file."""
    import jobs  # here: worker processes import this module with only tests/checkpoint on their path

    return jobs.run_ranks(os.path.join(HERE, script), world, argv)


def assert_every_rank_ok(results: list[tuple[int, str, str]], what: str) -> list[str]:
    """Each rank exited 0 and printed OK last; their stderr logs."""
    for rank, (code, out, err) in enumerate(results):
        assert code == 0 and out.strip().endswith("OK"), f"{what} rank {rank}:\n{err[-4000:]}"
    return [err for _, _, err in results]


def assert_same_tree(a: Any, b: Any, where: str = "") -> None:
    """The same nested dicts / lists of values and torch tensors (bit for bit, dtype too)."""
    import torch

    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and sorted(a, key=str) == sorted(b, key=str), (where, list(a), list(b))
        for key in a:
            assert_same_tree(a[key], b[key], f"{where}.{key}")
    elif isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple)) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same_tree(x, y, f"{where}[{i}]")
    else:
        assert a == b, (where, a, b)

"""Host staging and device placement without a GPU (tests/checkpoint/test_cuda.py has the rest)."""

from __future__ import annotations

import json
import logging
import os
import threading

import numpy as np
import pytest
import torch

from vertexrt.checkpoint import CheckpointManager, datafiles, staging, uploads
from vertexrt.checkpoint.storage import MANIFEST, step_name
from vertexrt.checkpoint.stores import OsStore
from vertexrt.errors import CheckpointError, ConfigError

DTYPES = [
    torch.bfloat16,
    torch.float16,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
    torch.complex64,
    torch.complex128,
    torch.bool,
    torch.int8,
    torch.uint8,
    torch.int64,
]


def _tensor(dtype: torch.dtype, n: int = 1000) -> torch.Tensor:
    gen = torch.Generator().manual_seed(3)
    if dtype == torch.bool:
        return torch.rand(n, generator=gen) > 0.5
    if dtype.is_complex:
        return torch.randn(n, dtype=dtype, generator=gen)
    if not dtype.is_floating_point:
        return torch.randint(0, 100, (n,), generator=gen).to(dtype)
    return torch.randn(n, generator=gen).to(dtype)


@pytest.mark.parametrize("async_save", [False, True])
def test_every_dtype_round_trips_bit_exactly(tmp_path, async_save):
    state = {str(d).removeprefix("torch."): _tensor(d) for d in DTYPES}
    conj = torch.randn(4, 3, dtype=torch.complex64).conj()  # lazily conjugated
    state["conj_t"] = conj.t()  # and not contiguous
    with CheckpointManager(str(tmp_path), async_save=async_save, rank=0, world_size=1) as mgr:
        mgr.save(1, state)
    with CheckpointManager(str(tmp_path), rank=0, world_size=1) as mgr:
        got = mgr.restore()
    for key, want in state.items():
        assert got[key].dtype == want.dtype and got[key].shape == want.shape, key
        assert torch.equal(
            got[key].view(-1).view(torch.uint8), want.resolve_conj().reshape(-1).view(torch.uint8)
        )


def test_async_snapshot_copies_large_and_small_leaves_in_parallel_chunks():
    big = np.arange(3 * staging.CHUNK // 8 + 5, dtype=np.int64)  # spans 4 chunks
    small = [np.full(100 + i, i, dtype=np.uint8) for i in range(50)]
    state = {"big": big, "small": small, "t": torch.arange(1000, dtype=torch.float32)}
    from vertexrt.checkpoint import serialization

    _, leaves = serialization.encode(state, allow_pickle=False)
    encoded = [enc for _, enc in leaves]
    stager = staging.Stager(threads=4)
    staged = stager.stage(encoded, copy_host=True)
    big[:] = -1
    for s in small:
        s[:] = 255
    state["t"].zero_()
    assert np.array_equal(staged[0].view(np.int64), np.arange(len(big)))
    for i, buf in enumerate(staged[1:51]):
        assert np.array_equal(buf, np.full(100 + i, i, dtype=np.uint8))
    assert np.array_equal(staged[51].view(np.float32), np.arange(1000, dtype=np.float32))
    base = stager.arena.array.ctypes.data
    assert all((buf.ctypes.data - base) % staging.ALIGN == 0 for buf in staged)


def test_sync_staging_uses_live_cpu_memory_without_a_copy():
    from vertexrt.checkpoint import serialization

    arr = np.arange(10.0)
    _, leaves = serialization.encode({"a": arr}, allow_pickle=False)
    staged = staging.Stager().stage([enc for _, enc in leaves], copy_host=False)
    assert np.shares_memory(staged[0], arr)


def test_arena_is_reused_and_grows_with_the_state():
    arena = staging.Arena()
    first = arena.reserve(1000, pinned=False)
    assert len(first) == 1000 and not arena.pinned
    assert arena.reserve(600, pinned=False) is first  # smaller state: same buffer
    grown = arena.reserve(1100, pinned=False)
    assert len(grown) == 1250  # grows by at least a quarter: few re-allocations while the state grows
    assert arena.reserve(5000, pinned=False) is not grown and len(arena) == 5000


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine where pinning host memory fails")
def test_pinning_that_fails_falls_back_to_pageable_memory_with_a_warning(caplog):
    arena = staging.Arena()
    with caplog.at_level(logging.WARNING, logger="vertexrt.checkpoint.staging"):
        buf = arena.reserve(4096, pinned=True)
        arena.settle()
        again = arena.reserve(4096, pinned=True)
    assert len(buf) == 4096 and not arena.pinned and again is buf
    assert "could not pin 4096 bytes" in caplog.text and "pageable" in caplog.text
    assert caplog.text.count("could not pin") == 1  # tried once, not on every save


class _Registry:
    """Stands in for cudaHostRegister / cudaHostUnregister (no CUDA here): records calls, pins nothing."""

    def __init__(self, fail: bool = False) -> None:
        self.fail = fail
        self.calls: list[tuple[str, int, int]] = []  # (what, bytes or 0, thread id)
        self.locked: dict[int, int] = {}

    def register(self, address: int, nbytes: int) -> None:
        if self.fail:
            raise RuntimeError("cudaHostRegister failed with CUDA error 2")
        self.calls.append(("register", nbytes, threading.get_ident()))
        self.locked[address] = nbytes

    def unregister(self, address: int) -> None:
        self.calls.append(("unregister", self.locked.pop(address), threading.get_ident()))

    @property
    def pinned(self) -> int:
        return sum(self.locked.values())


GIB = 1 << 30


def test_the_pinned_block_is_the_state_size_pinned_off_the_calling_thread_and_reused():
    registry = _Registry()
    arena = staging.Arena(registry, limit=lambda: 100 * GIB)
    state = 40 * 1000**3 // 10**4 * 10 + 3 * 4096  # not a power of two
    first = arena.reserve(state, pinned=True)
    assert not arena.pinned and len(first) >= state  # the first save: pageable while the block is pinned
    arena.settle()
    assert [(what, size) for what, size, _ in registry.calls] == [("register", staging.page_rounded(state))]
    assert registry.calls[0][2] != threading.get_ident()  # pinned on a background thread
    second = arena.reserve(state, pinned=True)
    assert arena.pinned and len(second) == state and not np.shares_memory(first, second)
    assert arena.pinned_bytes == registry.pinned == staging.page_rounded(state) < 2 * state
    assert arena.reserve(state - 4096, pinned=True) is second  # a smaller state: the same block
    assert len(registry.calls) == 1


def test_a_grown_state_unlocks_the_old_block_before_locking_a_new_one():
    registry = _Registry()
    arena = staging.Arena(registry, limit=lambda: GIB)
    arena.reserve(10 * 4096, pinned=True)
    arena.settle()
    arena.reserve(10 * 4096, pinned=True)
    assert registry.pinned == 10 * 4096
    grown = arena.reserve(25 * 4096, pinned=True)
    assert not arena.pinned and len(grown) >= 25 * 4096
    arena.settle()
    assert [(what, size) for what, size, _ in registry.calls] == [
        ("register", 10 * 4096),
        ("unregister", 10 * 4096),
        ("register", 25 * 4096),
    ]
    assert len(arena.reserve(25 * 4096, pinned=True)) == 25 * 4096 and arena.pinned
    assert registry.pinned == 25 * 4096  # never both blocks at once


def test_release_unlocks_the_pinned_block():
    registry = _Registry()
    stager = staging.Stager(arena=staging.Arena(registry, limit=lambda: GIB))
    stager.arena.reserve(5 * 4096 + 1, pinned=True)
    stager.arena.settle()
    assert registry.pinned == 6 * 4096
    stager.close()
    assert registry.pinned == 0 and stager.arena.pinned_bytes == 0
    assert [what for what, _, _ in registry.calls] == ["register", "unregister"]


def test_release_while_pinning_waits_for_the_block_and_unlocks_it():
    registry = _Registry()
    arena = staging.Arena(registry, limit=lambda: GIB)
    arena.reserve(8 * 4096, pinned=True)
    arena.release()
    assert registry.pinned == 0 and [what for what, _, _ in registry.calls] == ["register", "unregister"]


def test_a_state_over_the_pinned_limit_stays_pageable_with_a_warning_naming_the_variable(caplog):
    registry = _Registry()
    arena = staging.Arena(registry, limit=lambda: 16 * 4096)
    with caplog.at_level(logging.WARNING, logger="vertexrt.checkpoint.staging"):
        for _ in range(3):
            buf = arena.reserve(17 * 4096, pinned=True)
            arena.settle()
    assert len(buf) == 17 * 4096 and not arena.pinned and registry.calls == []
    assert caplog.text.count("VERTEXRT_PINNED_LIMIT") == 2 and "pageable" in caplog.text  # warned once


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("0", 0),
        ("123456", 123456),
        ("32GiB", 32 * GIB),
        ("8g", 8 * GIB),
        ("512 MiB", 512 << 20),
        ("1T", 1 << 40),
    ],
)
def test_the_pinned_limit_reads_bytes_with_binary_suffixes(monkeypatch, value, expected):
    monkeypatch.setenv("VERTEXRT_PINNED_LIMIT", value)
    assert staging.pinned_limit() == expected


@pytest.mark.parametrize("value", ["1.5G", "-3", "lots", "12 PB"])
def test_a_malformed_pinned_limit_is_a_config_error_naming_the_variable(monkeypatch, value):
    monkeypatch.setenv("VERTEXRT_PINNED_LIMIT", value)
    with pytest.raises(ConfigError, match="VERTEXRT_PINNED_LIMIT="):
        staging.pinned_limit()


def test_the_default_pinned_limit_is_a_share_of_host_memory_per_local_process(monkeypatch):
    monkeypatch.delenv("VERTEXRT_PINNED_LIMIT", raising=False)
    for name, value in {"RANK": "0", "WORLD_SIZE": "8", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "8"}.items():
        monkeypatch.setenv(name, value)
    memory = staging.host_memory()
    assert 0 < memory <= os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    assert staging.pinned_limit() == int(memory * staging.PINNED_FRACTION) // 8


def test_device_copies_of_optimizer_owned_leaves_are_queued_last():
    jobs = [(0, "param", 0, True), (1, "buffer", 10, False), (2, "moment", 20, True), (3, "rng", 30, False)]
    urgent, deferred = staging.copy_order(jobs)
    assert [j[0] for j in urgent] == [1, 3] and [j[0] for j in deferred] == [0, 2]


def test_a_conjugate_or_negative_view_target_is_not_filled_with_raw_bytes():
    source = torch.randn(6, dtype=torch.complex64)
    assert uploads.byte_copyable(source, torch.zeros(6, dtype=torch.complex64))
    assert not uploads.byte_copyable(source, torch.zeros(6, dtype=torch.complex64).conj())
    assert not uploads.byte_copyable(source.real, torch.zeros(6)._neg_view())
    assert not uploads.byte_copyable(source, torch.zeros(3, 2, dtype=torch.complex64).t())
    assert not uploads.byte_copyable(source, torch.zeros(6, dtype=torch.complex128))


class _Landing:
    """Stands in for a CUDA event: the bytes land in the buffer when the writer synchronizes on it."""

    def __init__(self, buffer: np.ndarray, value: int) -> None:
        self.buffer, self.value, self.lock = buffer, value, threading.Lock()

    def synchronize(self) -> None:
        with self.lock:
            self.buffer[:] = self.value


def test_writer_waits_for_each_leaf_before_checksumming_and_writing_it(tmp_path):
    buffers = [np.zeros(1000, dtype=np.uint8) for _ in range(5)]
    staged = staging.Staged(buffers, {i: _Landing(b, i + 1) for i, b in enumerate(buffers)})
    nodes: list[dict] = [{} for _ in buffers]
    store = OsStore()
    files = datafiles.write(store, str(tmp_path), "d", nodes, staged, part_size=2048, threads=2)
    got = datafiles.read(store, str(tmp_path), "d", files, nodes, threads=2)
    for i, buf in enumerate(got):
        assert np.array_equal(buf, np.full(1000, i + 1, dtype=np.uint8))


def test_restore_device_cpu_returns_cpu_tensors(tmp_path):
    with CheckpointManager(str(tmp_path), async_save=False, rank=0, world_size=1) as mgr:
        mgr.save(1, {"w": torch.arange(6.0)})
        got = mgr.restore(device="cpu")
    assert got["w"].device.type == "cpu" and torch.equal(got["w"], torch.arange(6.0))


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
@pytest.mark.parametrize("device", ["cuda", "cuda:0", "not-a-device", "meta"])
def test_restore_to_a_device_this_machine_lacks_is_a_clear_error(tmp_path, device):
    with CheckpointManager(str(tmp_path), async_save=False, rank=0, world_size=1) as mgr:
        mgr.save(1, {"w": torch.arange(6.0)})
        with pytest.raises(CheckpointError, match=r"restore\(device="):
            mgr.restore(device=device)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_a_cuda_checkpoint_restores_on_the_cpu_with_a_warning_here(tmp_path, caplog):
    with CheckpointManager(str(tmp_path), async_save=False, rank=0, world_size=1) as mgr:
        mgr.save(1, {"w": torch.arange(6.0), "b": torch.ones(2, dtype=torch.bfloat16)})
    manifest = os.path.join(str(tmp_path), step_name(1), MANIFEST)
    with open(manifest, "rb") as f:
        doc = json.loads(f.read())
    for body in doc["shards"]:
        for node in body["tree"]["v"]:
            node["device"] = "cuda:0"  # as a GPU machine writes it
    with open(manifest, "w") as f:
        json.dump(doc, f)
    with CheckpointManager(str(tmp_path), rank=0, world_size=1) as mgr:
        with caplog.at_level(logging.WARNING, logger="vertexrt.checkpoint.restoring"):
            got = mgr.restore()
        assert got["w"].device.type == "cpu" and torch.equal(got["w"], torch.arange(6.0))
        assert caplog.text.count("saved on cuda:0") == 1  # one warning per restore, not per tensor
        target = {"w": torch.zeros(6), "b": torch.zeros(2, dtype=torch.bfloat16)}
        mgr.restore(target=target)
        assert torch.equal(target["w"], torch.arange(6.0))


def test_close_stops_the_copy_threads(tmp_path) -> None:
    """The parallel host copy's threads end with the manager (no thread left per closed manager)."""
    state = {"big": np.arange(12 << 20, dtype=np.int64)}  # 96 MiB: several parallel copy chunks
    with CheckpointManager(str(tmp_path), async_save=True) as mgr:
        mgr.save(1, state)
        assert any(t.name.startswith("vertexrt-ckpt-copy") for t in threading.enumerate())
    assert not any(t.name.startswith("vertexrt-ckpt-copy") for t in threading.enumerate())


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_a_mixed_cpu_cuda_checkpoint_restores_on_the_cpu_here_and_refuses_a_cuda_device(tmp_path, caplog):
    state = {
        "gpu": torch.arange(6.0),
        "cpu": torch.arange(3, dtype=torch.int64),
        "fp8": torch.ones(4).to(torch.float8_e4m3fn),
    }
    with CheckpointManager(str(tmp_path), async_save=False, rank=0, world_size=1) as mgr:
        mgr.save(1, state)
    manifest = os.path.join(str(tmp_path), step_name(1), MANIFEST)
    with open(manifest, "rb") as f:
        doc = json.loads(f.read())
    tree = doc["shards"][0]["tree"]
    for key, node in zip(tree["k"], tree["v"], strict=True):
        if key in ("gpu", "fp8"):
            node["device"] = "cuda:0"  # as a GPU machine writes a mixed tree
    with open(manifest, "w") as f:
        json.dump(doc, f)
    with CheckpointManager(str(tmp_path), rank=0, world_size=1) as mgr:
        with caplog.at_level(logging.WARNING, logger="vertexrt.checkpoint.restoring"):
            got = mgr.restore()
        assert caplog.text.count("saved on cuda:0") == 1
        for key, want in state.items():
            assert got[key].device.type == "cpu" and got[key].dtype == want.dtype, key
            assert torch.equal(got[key].view(torch.uint8), want.view(torch.uint8)), key
        with pytest.raises(CheckpointError, match=r"restore\(device='cuda'\)"):
            mgr.restore(device="cuda")


class _Event:
    """Stands in for torch.cuda.Event on a CPU tensor's "stream": records which thread queued each copy."""

    queued_by: list[int] = []

    def record(self, stream: object = None) -> None:
        _Event.queued_by.append(threading.get_ident())

    def synchronize(self) -> None:
        pass


def test_restore_uploads_are_all_queued_on_the_calling_thread_before_copy_returns(monkeypatch):
    """Threads only fill bounce buffers: every copy is queued (here: run) by the caller, in order, before
    ``copy`` returns, so what the caller queues next on the stream reads the restored bytes."""
    import contextlib

    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: "stream")
    monkeypatch.setattr(torch.cuda, "stream", lambda stream: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "Event", _Event)
    _Event.queued_by = []
    registry = _Registry()
    source = torch.arange(10 * 1024 + 300, dtype=torch.float32)  # 10.3 chunks of 4 KiB
    target = torch.zeros_like(source)  # a CPU tensor: its copy_ runs when queued
    uploader = uploads.Uploader(slots=4, chunk=4096, registry=registry)
    uploader.copy(source.view(torch.uint8).numpy(), target)
    assert torch.equal(target, source)  # before finish(): every byte is in place
    assert len(_Event.queued_by) == 11 and set(_Event.queued_by) == {threading.get_ident()}
    small = torch.full((7,), 3.0)
    uploader.copy(small.view(torch.uint8).numpy(), (out := torch.zeros(7)))
    assert torch.equal(out, small)
    uploader.finish()
    assert registry.pinned == 0 and [what for what, _, _ in registry.calls] == ["register", "unregister"]
    assert registry.calls[0][1] == 4 * 4096  # one block of bounce buffers, slots x chunk

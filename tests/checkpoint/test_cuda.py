"""CUDA checkpoints: pinned staging, no torn values, restore straight to the device. Skipped without a GPU.

Run on the GPU machine: ``PYTHONPATH=src python3 -m pytest -q --noconftest tests/checkpoint/test_cuda.py``.
"""

from __future__ import annotations

import glob
import os

import pytest

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

from vertexrt.checkpoint import CheckpointManager  # noqa: E402
from vertexrt.errors import CheckpointCorruptError  # noqa: E402

MIB = 1 << 20


def _manager(root, **kwargs):
    return CheckpointManager(str(root), rank=0, world_size=1, **kwargs)


def _bits(t):
    return t.detach().resolve_conj().contiguous().cpu().reshape(-1).view(torch.uint8)


def _mixed_state():
    gen = torch.Generator(device="cuda").manual_seed(1)
    big = torch.rand(40 * MIB // 4, generator=gen, device="cuda")  # spans several bounce buffers
    return {
        "big": big,
        "bf16": torch.randn(1000, device="cuda").to(torch.bfloat16),
        "fp8": torch.randn(1000, device="cuda").to(torch.float8_e4m3fn),
        "complex": torch.randn(300, dtype=torch.complex64, device="cuda").conj(),
        "strided": torch.randn(64, 32, device="cuda").t(),
        "cpu": torch.arange(10.0),
        "empty": torch.empty(0, device="cuda"),
        "step": torch.tensor(7, device="cuda"),
    }


def test_async_save_is_not_torn_by_the_next_step_and_does_not_wait_for_the_gpu(tmp_path):
    tensors = [torch.zeros(16 * MIB // 4, device="cuda") for _ in range(8)]
    torch.cuda.synchronize()
    with _manager(tmp_path, async_save=True) as mgr:
        torch.cuda._sleep(2_000_000_000)  # the GPU is busy with the step (about a second)...
        for t in tensors:
            t.fill_(1.0)  # ...which ends with these values: the ones to save
        mgr.save(1, {"w": tensors})
        still_busy = not torch.cuda.current_stream().query()
        for t in tensors:
            t.fill_(2.0)  # the next step mutates right away
        mgr.wait()
        got = mgr.restore(device="cpu")
    assert still_busy, "save() waited for the GPU"
    assert all(bool((t == 1.0).all()) for t in got["w"])
    assert all(bool((t == 2.0).all()) for t in tensors)


@pytest.mark.parametrize("async_save", [False, True])
def test_mixed_cpu_cuda_tree_round_trips_to_the_devices_it_was_saved_on(tmp_path, async_save):
    state = _mixed_state()
    with _manager(tmp_path, async_save=async_save) as mgr:
        mgr.save(1, state)
        mgr.wait()
        assert mgr._staging.arena.pinned  # the staging arena is pinned host memory
        got = mgr.restore()
        on_cpu = mgr.restore(device="cpu")
        on_gpu = mgr.restore(device="cuda")
    for key, want in state.items():
        assert got[key].device == want.device, key
        assert got[key].dtype == want.dtype and got[key].shape == want.shape, key
        assert torch.equal(_bits(got[key]), _bits(want)), key
        assert on_cpu[key].device.type == "cpu" and torch.equal(_bits(on_cpu[key]), _bits(want)), key
        assert on_gpu[key].device.type == "cuda" and torch.equal(_bits(on_gpu[key]), _bits(want)), key


def test_the_pinned_arena_is_reused_across_saves(tmp_path):
    state = {"w": torch.rand(MIB, device="cuda")}
    with _manager(tmp_path, async_save=True) as mgr:
        mgr.save(1, state)
        mgr.wait()
        first = mgr._staging.arena.array.ctypes.data
        state["w"].add_(1)
        mgr.save(2, state)
        mgr.wait()
        assert mgr._staging.arena.array.ctypes.data == first
        got = mgr.restore(step=2, device="cpu")
    assert torch.equal(got["w"], state["w"].cpu())


def test_restore_into_cuda_targets_from_cuda_and_cpu_checkpoints(tmp_path):
    state = _mixed_state()
    with _manager(tmp_path / "gpu", async_save=False) as mgr:
        mgr.save(1, state)
        target = {k: torch.zeros_like(v) for k, v in state.items()}
        target["strided"] = torch.zeros(32, 64, device="cuda").t()  # a non-contiguous target
        out = mgr.restore(target=target)
    for key, want in state.items():
        assert out[key] is target[key] and torch.equal(_bits(target[key]), _bits(want)), key

    cpu_state = {"w": torch.rand(3 * MIB), "b": torch.rand(10).to(torch.bfloat16)}
    with _manager(tmp_path / "cpu", async_save=False) as mgr:
        mgr.save(1, cpu_state)
        gpu_target = {k: torch.zeros_like(v, device="cuda") for k, v in cpu_state.items()}
        mgr.restore(target=gpu_target)
    for key, want in cpu_state.items():
        assert gpu_target[key].device.type == "cuda" and torch.equal(gpu_target[key].cpu(), want), key

    with _manager(tmp_path / "gpu", async_save=False) as mgr:
        cpu_target = {k: torch.zeros_like(v, device="cpu") for k, v in state.items()}
        mgr.restore(target=cpu_target)
    assert torch.equal(_bits(cpu_target["big"]), _bits(state["big"]))


def test_a_corrupt_byte_is_caught_before_any_cuda_target_changes(tmp_path):
    state = {"w": torch.rand(4 * MIB, device="cuda")}
    with _manager(tmp_path, async_save=False) as mgr:
        mgr.save(1, state)
    (data,) = [p for p in glob.glob(os.path.join(str(tmp_path), "*", "*.bin"))]
    with open(data, "r+b") as f:
        f.seek(1000)
        byte = f.read(1)
        f.seek(1000)
        f.write(bytes([byte[0] ^ 0xFF]))
    target = {"w": torch.full((4 * MIB,), 5.0, device="cuda")}
    with _manager(tmp_path) as mgr, pytest.raises(CheckpointCorruptError, match="checksum mismatch"):
        mgr.restore(step=1, target=target)
    assert bool((target["w"] == 5.0).all())

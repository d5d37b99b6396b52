"""Pinned host memory of CUDA checkpoint staging, at the scale of issue 24. Skipped without a GPU; slow.

Run on the GPU machine with tests/checkpoint/test_cuda.py (see its docstring for the command).
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.slow,
]

from vertexrt.checkpoint import CheckpointManager  # noqa: E402

GIB = 1 << 30


def _torch_pinned() -> int:
    """Bytes held by torch's own pinned host allocator (which rounds each block up to a power of two)."""
    stats = getattr(torch.cuda, "host_memory_stats", dict)()  # torch >= 2.7
    return int(stats.get("allocated_bytes.current", 0))


def test_pinned_memory_of_a_9_gib_async_save_is_about_the_state_and_none_after_close(tmp_path):
    state = {f"w{i}": torch.full((GIB // 4,), float(i), device="cuda") for i in range(9)}
    total = 9 * GIB
    torch.cuda.synchronize()
    before = _torch_pinned()
    mgr = CheckpointManager(str(tmp_path), async_save=True, rank=0, world_size=1)
    try:
        mgr.save(1, state)  # staged in pageable memory while the arena is pinned in the background
        mgr.wait()
        arena = mgr._staging.arena
        arena.settle()
        mgr.save(2, state)
        during = arena.pinned_bytes + _torch_pinned() - before
        assert arena.pinned, "the second save should use the pinned arena"
        assert total <= during <= 1.1 * total, f"{during / GIB:.2f} GiB pinned for a 9 GiB state"
        mgr.wait()
    finally:
        mgr.close()
    after = arena.pinned_bytes + _torch_pinned() - before
    assert after <= 64 << 20, f"{after / GIB:.2f} GiB still pinned after close()"
    with CheckpointManager(str(tmp_path), rank=0, world_size=1) as reader:
        got = reader.restore(step=2, device="cuda")
    assert all(bool((got[k] == float(i)).all()) for i, k in enumerate(state))
    torch.cuda.synchronize()
    assert _torch_pinned() - before <= 64 << 20  # the restore's bounce buffers are returned too

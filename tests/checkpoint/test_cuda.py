"""CUDA checkpoints: pinned staging, no torn values, restore straight to the device. Skipped without a GPU.

Run on the GPU machine (``--noconftest``: these tests use none of the fixtures, whose dependencies are
missing there)::

    PYTHONPATH=src python3 -m pytest -q -p no:cacheprovider --noconftest \
        tests/checkpoint/test_cuda.py tests/checkpoint/test_cuda_memory.py
"""

from __future__ import annotations

import glob
import os

import pytest

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

from vertexrt.checkpoint import CheckpointManager, rng_state, serialization  # noqa: E402
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


def _warm(mgr, state):
    """One save, then wait until the arena is pinned (the first save stages into pageable memory)."""
    mgr.save(0, state, force=True)
    mgr.wait()
    mgr._staging.arena.settle()
    torch.cuda.synchronize()


def test_async_save_is_not_torn_by_the_next_step_and_does_not_wait_for_the_gpu(tmp_path):
    tensors = [torch.zeros(16 * MIB // 4, device="cuda") for _ in range(8)]
    torch.cuda.synchronize()
    with _manager(tmp_path, async_save=True) as mgr:
        _warm(mgr, {"w": tensors})
        torch.cuda._sleep(2_000_000_000)  # the GPU is busy with the step (about a second)...
        for t in tensors:
            t.fill_(1.0)  # ...which ends with these values: the ones to save
        mgr.save(1, {"w": tensors})
        still_busy = not torch.cuda.current_stream().query()
        for t in tensors:
            t.fill_(2.0)  # the next step mutates right away
        mgr.wait()
        got = mgr.restore(step=1, device="cpu")
    assert still_busy, "save() waited for the GPU"
    assert all(bool((t == 1.0).all()) for t in got["w"])
    assert all(bool((t == 2.0).all()) for t in tensors)


@pytest.mark.parametrize("async_save", [False, True])
def test_mixed_cpu_cuda_tree_round_trips_to_the_devices_it_was_saved_on(tmp_path, async_save):
    state = _mixed_state()
    with _manager(tmp_path, async_save=async_save) as mgr:
        mgr.save(1, state)  # pageable while the arena is pinned in the background
        mgr.wait()
        mgr._staging.arena.settle()
        mgr.save(2, state, force=True)
        mgr.wait()
        assert mgr._staging.arena.pinned  # from the second save on: pinned host memory
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
        mgr._staging.arena.settle()
        mgr.save(2, state)
        mgr.wait()
        first = mgr._staging.arena.array.ctypes.data
        assert mgr._staging.arena.pinned and mgr._staging.arena.array.ctypes.data == first
        state["w"].add_(1)
        mgr.save(3, state)
        mgr.wait()
        assert mgr._staging.arena.array.ctypes.data == first
        got = mgr.restore(step=3, device="cpu")
    assert torch.equal(got["w"], state["w"].cpu())


def test_restore_into_cuda_targets_from_cuda_and_cpu_checkpoints(tmp_path):
    state = _mixed_state()
    with _manager(tmp_path / "gpu", async_save=False) as mgr:
        mgr.save(1, state)
        target = {k: torch.zeros_like(v) for k, v in state.items()}
        target["strided"] = torch.zeros(64, 32, device="cuda").t()  # a non-contiguous target, [32, 64]
        target["complex"] = torch.zeros(300, dtype=torch.complex64, device="cuda").conj()  # a conj view
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


def _model_and_adam(width: int = 256, layers: int = 3) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    blocks = [
        torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.BatchNorm1d(width)) for _ in range(layers)
    ]
    model = torch.nn.Sequential(*blocks).cuda()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    _train(model, opt, 1)
    return model, opt


def _train(model: torch.nn.Module, opt: torch.optim.Optimizer, steps: int) -> None:
    width = model[0][0].in_features
    for _ in range(steps):
        opt.zero_grad()
        model(torch.randn(64, width, device="cuda")).square().mean().backward()
        opt.step()


def _clone(tree):
    if isinstance(tree, dict):
        return {k: _clone(v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [_clone(v) for v in tree]
    return tree.detach().clone() if isinstance(tree, torch.Tensor) else tree


def _assert_equal_trees(got, want, path="state"):
    if isinstance(want, dict):
        assert set(got) == set(want), path
        for k in want:
            _assert_equal_trees(got[k], want[k], f"{path}[{k!r}]")
    elif isinstance(want, list):
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            _assert_equal_trees(g, w, f"{path}[{i}]")
    elif isinstance(want, torch.Tensor):
        assert torch.equal(g := got.to(want.device), want), (path, g, want)
    else:
        assert got == want, path


@pytest.mark.slow
def test_a_gib_module_and_a_gib_tensor_restored_with_device_cuda_equal_the_saved_values(tmp_path):
    """Issue 24 #1: the uploads are queued on the caller's stream before the target reads them."""
    gen = torch.Generator(device="cuda").manual_seed(2)
    module = torch.nn.Linear(16384, 16384, bias=False, device="cuda")  # 1 GiB of float32
    with torch.no_grad():
        module.weight.copy_(torch.rand(16384, 16384, generator=gen, device="cuda"))
    tensor = torch.rand(256 * MIB, generator=gen, device="cuda")  # 1 GiB
    want_weight, want_tensor = module.weight.detach().clone(), tensor.clone()
    with _manager(tmp_path, async_save=False) as mgr:
        mgr.save(1, {"module": module, "tensor": tensor})
        with torch.no_grad():
            module.weight.fill_(-1.0)
        tensor.fill_(-1.0)
        mgr.restore(target={"module": module, "tensor": tensor}, device="cuda")
        assert torch.equal(module.weight, want_weight)  # read on the same stream, right after restore()
        assert torch.equal(tensor, want_tensor)
        got = mgr.restore(device="cuda")
        assert torch.equal(got["module"]["weight"], want_weight) and torch.equal(got["tensor"], want_tensor)


@pytest.mark.parametrize("with_target", [True, False])
def test_adam_step_and_rng_state_stay_on_the_cpu_after_a_restore_with_device_cuda(tmp_path, with_target):
    """Issue 24 #2: device= moves model and optimizer data, never step counters or generator states."""
    model, opt = _model_and_adam()
    torch.cuda.manual_seed(5)
    state = {"model": model, "opt": opt, "rng": rng_state()}
    with _manager(tmp_path, async_save=False) as mgr:
        mgr.save(1, state)
        want = torch.rand(4, device="cuda")
        if with_target:
            mgr.restore(target=state, device="cuda")  # sets the generators back: no error
            assert torch.equal(torch.rand(4, device="cuda"), want)
            steps = [s["step"] for s in opt.state.values()]
            moments = [s["exp_avg"] for s in opt.state.values()]
        else:
            got = mgr.restore(device="cuda")
            steps = [s["step"] for s in got["opt"]["state"].values()]
            moments = [s["exp_avg"] for s in got["opt"]["state"].values()]
            assert got["rng"]["torch"].device.type == "cpu"
            assert all(s.device.type == "cpu" for s in got["rng"]["cuda"])
            rng_state().load_state_dict(got["rng"])
            assert torch.equal(torch.rand(4, device="cuda"), want)
    assert steps and all(s.device.type == "cpu" for s in steps)
    assert all(m.device.type == "cuda" for m in moments)
    _train(model, opt, 2)  # Adam takes its step from the CPU: no per-parameter GPU sync


def test_an_rng_state_saved_with_two_visible_gpus_loads_where_one_is_visible():
    """Issue 24 #7: the state of the GPU that was current is restored; the invisible one is skipped."""
    torch.cuda.init()
    state = rng_state().state_dict()
    other = torch.cuda.get_rng_state(0)
    torch.cuda.manual_seed(1234)
    current = torch.cuda.get_rng_state(0)
    state["cuda"] = [other, current]  # as saved by a process whose current device was cuda:1 of 2
    state["cuda_current"] = 1
    torch.cuda.manual_seed(99)
    if torch.cuda.device_count() != 1:
        pytest.skip("needs exactly one visible GPU (CUDA_VISIBLE_DEVICES=0)")
    rng_state().load_state_dict(state)
    assert torch.equal(torch.cuda.get_rng_state(0), current)


def test_saved_parameters_and_moments_are_not_torn_by_the_next_optimizer_steps(tmp_path):
    """Issue 24 #5: parameter / moment copies overlap the next forward and backward; the next optimizer step
    waits for them on its stream; other leaves (BatchNorm statistics) are waited for at once."""
    model, opt = _model_and_adam()
    state = {"model": model, "opt": opt}
    _, leaves = serialization.encode(state, allow_pickle=False)
    names = list(model.state_dict())
    by_name = {name: enc for name, (_, enc) in zip(names, leaves[: len(names)], strict=True)}
    assert by_name["0.0.weight"].optimizer_owned and by_name["2.1.bias"].optimizer_owned
    assert not by_name["0.1.running_mean"].optimizer_owned  # a buffer: forward changes it
    moments = [enc for node, enc in leaves[len(names) :] if node["t"] == "torch" and node["shape"]]
    assert moments and all(enc.optimizer_owned for enc in moments)  # exp_avg / exp_avg_sq
    with _manager(tmp_path, async_save=True) as mgr:
        for step in (1, 2):  # the second save uses the pinned arena
            want = {"model": _clone(model.state_dict()), "opt": _clone(opt.state_dict()["state"])}
            mgr.save(step, state, force=True)
            assert mgr._staging._before_step._events  # the compute stream has not waited for them yet
            with torch.no_grad():
                model[0][1].running_mean.add_(100.0)  # a buffer changed right away
            _train(model, opt, 3)  # the next steps change every parameter and moment
            assert not mgr._staging._before_step._events  # the first optimizer step waited
            mgr.wait()
            mgr._staging.arena.settle()
        got = mgr.restore(step=2, device="cuda")
    _assert_equal_trees(got["model"], want["model"])
    _assert_equal_trees(got["opt"]["state"], want["opt"])


def test_cuda_metrics_are_saved_without_waiting_for_the_gpu(tmp_path):
    """Issue 24 #9: a CUDA metric is copied behind an event and read by the writer, not with .item()."""
    loss = torch.zeros((), device="cuda")
    state = {"w": torch.ones(4, device="cuda")}
    with _manager(tmp_path, async_save=True) as mgr:
        _warm(mgr, state)
        torch.cuda._sleep(2_000_000_000)  # the step is still running on the GPU...
        loss.fill_(0.5)  # ...and ends with the loss
        mgr.save(1, state, metrics={"loss": loss})
        still_busy = not torch.cuda.current_stream().query()
        mgr.wait()
        assert mgr.metadata(1)["metrics"] == {"loss": 0.5}
    assert still_busy, "save() waited for the GPU to read the metric"

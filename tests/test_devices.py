"""Device selection with faked inventories, CUDA_VISIBLE_DEVICES, nvidia-smi parsing, NCCL defaults."""

from __future__ import annotations

import logging
import os
import stat
import sys

import pytest
from jobs import run_job

from vertexrt import devices, gpus
from vertexrt.devices import GPU, filter_visible, parse_nvidia_smi, select_device, visible_devices
from vertexrt.errors import ConfigError

SMI = """0, GPU-aaaa1111-0000, NVIDIA A100-SXM4-40GB, 40960
1, GPU-bbbb2222-0000, NVIDIA A100-SXM4-40GB, 40960
2, GPU-cccc3333-0000, NVIDIA L4, 23034
3, GPU-dddd4444-0000, NVIDIA L4, [N/A]
"""
INVENTORY = parse_nvidia_smi(SMI)


@pytest.mark.parametrize(
    ("local_rank", "local_world_size", "num_gpus", "device"),
    [(0, 1, 0, "cpu"), (3, 4, 0, "cpu"), (0, 1, 8, "cuda:0"), (2, 4, 4, "cuda:2"), (1, 2, 8, "cuda:1")],
)
def test_select_device(local_rank: int, local_world_size: int, num_gpus: int, device: str) -> None:
    assert select_device(local_rank, local_world_size, num_gpus) == device


def test_more_processes_than_gpus_is_an_error_that_says_what_to_do() -> None:
    with pytest.raises(ConfigError, match=r"4 processes .*LOCAL_WORLD_SIZE.* only 2 visible .*nprocs='gpu'"):
        select_device(3, 4, 2)
    with pytest.raises(ConfigError, match="local_rank=2 is out of range"):
        select_device(2, 2, 2)


@pytest.mark.parametrize(
    ("value", "tokens"),
    [
        (None, None),
        ("", []),
        ("-1", []),
        ("0,2", ["0", "2"]),
        ("1, 0", ["1", "0"]),
        ("0,x,1", ["0"]),
        ("GPU-bbbb", ["GPU-bbbb"]),
    ],
)
def test_visible_devices_parses_like_cuda(value: str | None, tokens: list[str] | None) -> None:
    assert visible_devices(value) == tokens


def test_filter_visible_renumbers_in_the_order_given() -> None:
    assert filter_visible(INVENTORY, None) == INVENTORY
    chosen = filter_visible(INVENTORY, "2,0")
    assert [(g.index, g.name, g.uuid) for g in chosen] == [
        (0, "NVIDIA L4", "GPU-cccc3333-0000"),
        (1, "NVIDIA A100-SXM4-40GB", "GPU-aaaa1111-0000"),
    ]
    assert [g.uuid for g in filter_visible(INVENTORY, "GPU-dddd,GPU-bbbb")] == [
        "GPU-dddd4444-0000",
        "GPU-bbbb2222-0000",
    ]
    assert filter_visible(INVENTORY, "1,7,2") == [
        GPU(0, "NVIDIA A100-SXM4-40GB", 40960 << 20, "GPU-bbbb2222-0000")
    ]
    assert filter_visible(INVENTORY, "1,1") == [
        GPU(0, "NVIDIA A100-SXM4-40GB", 40960 << 20, "GPU-bbbb2222-0000")
    ]
    assert filter_visible(INVENTORY, "") == []


def test_parse_nvidia_smi_reads_names_memory_and_skips_noise() -> None:
    assert len(INVENTORY) == 4 and INVENTORY[2] == GPU(2, "NVIDIA L4", 23034 << 20, "GPU-cccc3333-0000")
    assert INVENTORY[3].memory_bytes is None
    assert parse_nvidia_smi("No devices were found\n") == []


def test_inventory_from_nvidia_smi_without_importing_a_framework(tmp_path, monkeypatch) -> None:
    fake = tmp_path / "nvidia-smi"
    fake.write_text(f"#!/bin/sh\ncat <<'EOF'\n{SMI}EOF\n")
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    for name in ("torch", "tensorflow"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    gpus = devices.gpu_inventory({"CUDA_VISIBLE_DEVICES": "3,1"})
    assert [(g.index, g.uuid) for g in gpus] == [(0, "GPU-dddd4444-0000"), (1, "GPU-bbbb2222-0000")]
    assert len(devices.gpu_inventory({})) == 4
    assert "torch" not in sys.modules and "tensorflow" not in sys.modules


def test_no_gpu_here_means_cpu(monkeypatch, tmp_path) -> None:
    with monkeypatch.context() as patch:
        patch.setenv("PATH", str(tmp_path))  # no nvidia-smi
        for name in ("torch", "tensorflow"):
            patch.delitem(sys.modules, name, raising=False)
        assert devices.gpu_inventory({}) == []
    assert str(devices.torch_device(0, 1)) == "cpu"
    assert devices.gpu_inventory({}) == [] and devices.gpu_count() == 0  # through torch, now imported


def test_nccl_defaults_only_fill_what_is_unset() -> None:
    env = {"NCCL_DEBUG": "INFO"}
    applied = devices.apply_nccl_defaults(env)
    assert applied == {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "1"}
    assert env == {"NCCL_DEBUG": "INFO", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1"}
    assert devices.apply_nccl_defaults(env) == {}


@pytest.mark.parametrize(
    ("module", "must_not_load"),
    [
        ("vertexrt.devices", ()),
        # devices asks distributed/ for the world; distributed/'s bootstraps take their GPU from
        # vertexrt.gpus, below both (tests/test_layers.py): no package leans back on devices
        ("vertexrt.gpus", ("vertexrt.distributed",)),
        ("vertexrt.distributed.detection", ("vertexrt.devices",)),
        ("vertexrt.distributed.torch", ("vertexrt.devices",)),
        ("vertexrt.distributed.launcher", ()),
        ("vertexrt.distributed", ("vertexrt.devices",)),
    ],
)
def test_each_module_imports_alone_and_devices_is_one_way(
    module: str, must_not_load: tuple[str, ...]
) -> None:
    code = f"import sys, {module}; print([m for m in {list(must_not_load)!r} if m in sys.modules])"
    out = run_job([sys.executable, "-c", code], None, 60, merge_stderr=False)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def _fake_smi(tmp_path, monkeypatch) -> None:
    fake = tmp_path / "nvidia-smi"
    fake.write_text(f"#!/bin/sh\ncat <<'EOF'\n{SMI}EOF\n")
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    for name in ("torch", "tensorflow"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setattr(gpus, "_warned_unused", set())


def test_one_process_with_several_gpus_warns_how_to_use_them(
    tmp_path, monkeypatch, clean_env, caplog
) -> None:
    _fake_smi(tmp_path, monkeypatch)  # 4 GPUs, one process (no torchrun, no spawn)
    with caplog.at_level(logging.WARNING, logger="vertexrt.devices"):
        assert devices.warn_unused_gpus() is True
        assert devices.warn_unused_gpus() is True  # warned once
    (record,) = [r.getMessage() for r in caplog.records]
    assert "4 GPUs are visible" in record and "3 GPU(s) stay idle" in record
    for hint in ("--processes-per-node 4", "spawn(fn, nprocs='gpu')", "torchrun --nproc-per-node=gpu"):
        assert hint in record


def test_one_process_per_gpu_does_not_warn(tmp_path, monkeypatch, clean_env, caplog) -> None:
    _fake_smi(tmp_path, monkeypatch)
    monkeypatch.setenv("LOCAL_RANK", "1")  # as torchrun / spawn / local-run --processes-per-node set them
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "4")
    with caplog.at_level(logging.WARNING, logger="vertexrt.devices"):
        assert devices.warn_unused_gpus() is False
        assert devices.warn_unused_gpus(local_world_size=1, num_gpus=1) is False
        assert devices.warn_unused_gpus(local_world_size=1, num_gpus=0) is False
    assert not caplog.records


def _node_with(gpus: int, tmp_path, monkeypatch) -> None:
    """A node whose nvidia-smi (which ignores CUDA_VISIBLE_DEVICES) lists ``gpus`` physical GPUs."""
    fake = tmp_path / "nvidia-smi"
    lines = "".join(SMI.splitlines(keepends=True)[:gpus])
    fake.write_text(f"#!/bin/sh\ncat <<'EOF'\n{lines}EOF\n")
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")


def test_a_wrapper_that_gives_each_process_its_own_gpu_is_accepted(monkeypatch, tmp_path) -> None:
    # 4 processes on a 4-GPU node, each started with CUDA_VISIBLE_DEVICES=<its GPU>: each sees one, cuda:0.
    _node_with(4, tmp_path, monkeypatch)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")
    assert select_device(3, 4, 1) == "cuda:0"
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-bbbb2222")
    assert select_device(1, 4, 1) == "cuda:0"


def test_one_gpu_made_visible_to_more_processes_than_the_node_has_gpus_is_an_error(monkeypatch, tmp_path):
    # CUDA_VISIBLE_DEVICES=0 for both processes of a 1-GPU node: they would share it (NCCL fails later).
    _node_with(1, tmp_path, monkeypatch)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    with pytest.raises(ConfigError, match=r"2 processes .* only 1 visible"):
        select_device(1, 2, 1)


def test_one_gpu_shared_by_every_process_of_the_node_is_still_an_error(monkeypatch) -> None:
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)  # the node has one GPU, all 4 would use it
    with pytest.raises(ConfigError, match=r"4 processes .* only 1 visible"):
        select_device(1, 4, 1)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")  # two visible: one each is not what the list says
    with pytest.raises(ConfigError, match=r"4 processes .* only 2 visible"):
        select_device(1, 4, 2)

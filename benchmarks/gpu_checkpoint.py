"""CUDA checkpoint save/restore: vertexrt against the hardware floor and its peers, in one run.

State: ``--gib`` GiB of float32 CUDA tensors shaped like a model plus Adam moments (45 parameters, each with
``exp_avg`` / ``exp_avg_sq``, and a step counter: 136 tensors). Rows, each the median of ``--repeats`` runs on
local disk, every save followed by fsync of its files so all rows are equally durable:

- floor: one pinned host buffer filled by non-blocking D2H copies (the least an async save must block), and
  D2H + raw write + fsync of the same bytes (the least a sync save costs);
- torch.save / torch.load(map_location="cuda"), torch.distributed.checkpoint save / load in place,
  safetensors save_file / load_file(device="cuda");
- vertexrt: sync save, async save (time the caller is blocked, and until committed), restore into live CUDA
  targets (every byte CRC32C-verified).

Ratios are baseline / vertexrt for times (> 1: vertexrt is faster).

A second table times training steps on the GPU with CUDA events (issue 24): an MLP of 4096-wide layers whose
parameters + Adam moments hold ``--step-gib`` GiB, plain steps against the two steps around each async save
(the save is called between them, so its host-side time and any wait it puts on the compute stream both show
up), and the pinned host memory the save holds against the state's size, during the save and after close().

Without CUDA it says so and exits 0.

Run: python benchmarks/gpu_checkpoint.py [--gib 4] [--repeats 3] [--step-gib 2] [--saves 5] [--batch 2048]
     [--dir /tmp/vertexrt-gpu-bench] [--only steps|io]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

MIB = 1 << 20


def build_state(total_bytes: int) -> dict[str, Any]:
    """45 parameters of mixed sizes + two Adam moments each + a step: 136 float32 CUDA tensors."""
    import torch

    weights = [1 + (i % 7) for i in range(45)]  # relative sizes
    per_unit = total_bytes // (3 * sum(weights) * 4)  # float32 elements per weight unit, x3 tensors
    gen = torch.Generator(device="cuda").manual_seed(0)
    model, exp_avg, exp_avg_sq = {}, {}, {}
    for i, w in enumerate(weights):
        n = max(1, w * per_unit)
        model[f"layer{i}.weight"] = torch.rand(n, generator=gen, device="cuda")
        exp_avg[f"layer{i}.weight"] = torch.rand(n, generator=gen, device="cuda")
        exp_avg_sq[f"layer{i}.weight"] = torch.rand(n, generator=gen, device="cuda")
    return {
        "model": model,
        "optimizer": {"exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq, "step": torch.tensor(7.0, device="cuda")},
    }


def flat(state: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in state.items():
        if isinstance(value, dict):
            out.update(flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def fsync_tree(path: str) -> None:
    paths = [path] if os.path.isfile(path) else [os.path.join(d, f) for d, _, fs in os.walk(path) for f in fs]
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)


def sync_cuda() -> None:
    import torch

    torch.cuda.synchronize()


def measure(fn: Callable[[int], Any], repeats: int, prepare: Callable[[int], Any] | None = None) -> float:
    times = []
    for i in range(repeats):
        if prepare is not None:
            prepare(i)
        sync_cuda()
        start = time.perf_counter()
        fn(i)
        sync_cuda()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def rows(state: dict[str, Any], root: str, repeats: int) -> tuple[dict[str, float], int]:
    import torch

    from vertexrt.checkpoint import CheckpointManager

    tensors = flat(state)
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    out: dict[str, float] = {}
    pinned = torch.empty(total, dtype=torch.uint8, pin_memory=True)

    def d2h_pinned(_: int) -> None:
        offset = 0
        for t in tensors.values():
            n = t.numel() * t.element_size()
            pinned[offset : offset + n].copy_(t.view(-1).view(torch.uint8), non_blocking=True)
            offset += n
        torch.cuda.synchronize()

    def raw_write(i: int) -> None:
        path = os.path.join(root, f"raw{i}.bin")
        with open(path, "wb", buffering=0) as f:
            view = memoryview(pinned.numpy())
            for start in range(0, total, 64 * MIB):
                f.write(view[start : start + 64 * MIB])
            os.fsync(f.fileno())

    def d2h_and_write(i: int) -> None:
        d2h_pinned(i)
        raw_write(i)

    def clean(_: int = 0) -> None:
        shutil.rmtree(root, ignore_errors=True)
        os.makedirs(root)

    out["floor: pinned D2H (async save's least block)"] = measure(d2h_pinned, repeats)
    out["floor: D2H + raw write + fsync"] = measure(d2h_and_write, repeats, clean)

    def torch_save(i: int) -> None:
        path = os.path.join(root, f"t{i}.pt")
        torch.save(state, path)
        fsync_tree(path)

    out["torch.save + fsync"] = measure(torch_save, repeats, clean)
    torch_save(0)
    out["torch.load(map_location=cuda)"] = measure(
        lambda _: torch.load(os.path.join(root, "t0.pt"), map_location="cuda", weights_only=True), repeats
    )

    try:
        import torch.distributed.checkpoint as dcp

        def dcp_save(i: int) -> None:
            path = os.path.join(root, f"dcp{i}")
            dcp.save(tensors, checkpoint_id=path)
            fsync_tree(path)

        out["DCP save + fsync"] = measure(dcp_save, repeats, clean)
        dcp_save(0)
        out["DCP load in place"] = measure(
            lambda _: dcp.load(tensors, checkpoint_id=os.path.join(root, "dcp0")), repeats
        )
    except Exception as exc:  # DCP without a process group differs across torch versions
        print(f"DCP rows skipped: {exc}", file=sys.stderr)

    try:
        from safetensors.torch import load_file, save_file

        def st_save(i: int) -> None:
            path = os.path.join(root, f"s{i}.safetensors")
            save_file(tensors, path)
            fsync_tree(path)

        out["safetensors save_file + fsync"] = measure(st_save, repeats, clean)
        st_save(0)
        out["safetensors load_file(device=cuda)"] = measure(
            lambda _: load_file(os.path.join(root, "s0.safetensors"), device="cuda"), repeats
        )
    except ImportError:
        print("safetensors rows skipped: not installed", file=sys.stderr)

    def vx_save(async_save: bool) -> Callable[[int], None]:
        def save(i: int) -> None:
            with CheckpointManager(
                os.path.join(root, "vx"), async_save=async_save, rank=0, world_size=1
            ) as m:
                m.save(i, state)

        return save

    out["vertexrt sync save"] = measure(vx_save(False), repeats, clean)
    blocked, committed = [], []
    for i in range(repeats):
        clean()
        manager = CheckpointManager(os.path.join(root, "vx"), async_save=True, rank=0, world_size=1)
        sync_cuda()
        start = time.perf_counter()
        manager.save(i, state)
        blocked.append(time.perf_counter() - start)
        manager.close()
        committed.append(time.perf_counter() - start)
    out["vertexrt async save: caller blocked"] = statistics.median(blocked)
    out["vertexrt async save: until committed"] = statistics.median(committed)
    clean()
    vx_save(False)(0)
    with CheckpointManager(os.path.join(root, "vx"), rank=0, world_size=1) as manager:
        out["vertexrt restore into CUDA targets"] = measure(lambda _: manager.restore(target=state), repeats)
    return out, total


def step_rows(gib: float, saves: int, batch: int, root: str) -> dict[str, float]:
    """Step times (CUDA events) of plain steps and of the steps around async saves; pinned bytes."""
    import torch

    from vertexrt.checkpoint import CheckpointManager

    width = 4096
    layers = max(1, round(gib * (1 << 30) / (3 * width * width * 4)))  # weight + exp_avg + exp_avg_sq
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width, bias=False) for _ in range(layers)]).cuda()
    opt = torch.optim.Adam(model.parameters(), lr=1e-5)
    data = torch.randn(batch, width, device="cuda")
    state = {"model": model, "opt": opt}

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        model(data).square().mean().backward()
        opt.step()

    def event() -> Any:
        e = torch.cuda.Event(enable_timing=True)
        e.record()
        return e

    for _ in range(5):
        step()
    torch.cuda.synchronize()
    marks = [event()]
    for _ in range(20):
        step()
        marks.append(event())
    torch.cuda.synchronize()
    plain = statistics.median(a.elapsed_time(b) / 1e3 for a, b in zip(marks, marks[1:], strict=False))
    state_bytes = sum(t.numel() * t.element_size() for t in model.parameters()) * 3
    out: dict[str, float] = {"plain step (s)": plain, "state (GiB)": state_bytes / (1 << 30)}
    shutil.rmtree(root, ignore_errors=True)
    mgr = CheckpointManager(os.path.join(root, "steps"), async_save=True, rank=0, world_size=1)
    try:
        mgr.save(0, state, force=True)  # the first save stages into pageable memory while the arena is pinned
        mgr.wait()
        mgr._staging.arena.settle()
        pairs, firsts, blocked = [], [], []
        pinned = 0
        for i in range(1, saves + 1):
            for _ in range(3):
                step()
            start = event()
            t0 = time.perf_counter()
            mgr.save(i, state, force=True)
            blocked.append(time.perf_counter() - t0)
            pinned = max(pinned, mgr._staging.arena.pinned_bytes)
            step()
            middle = event()
            step()
            end = event()
            torch.cuda.synchronize()
            firsts.append(start.elapsed_time(middle) / 1e3)
            pairs.append(start.elapsed_time(end) / 2e3)
            mgr.wait()  # the write finishes outside the timed steps
        arena = mgr._staging.arena
    finally:
        mgr.close()
    out["step right after save() (s)"] = statistics.median(firsts)
    out["mean of the 2 steps around a save (s)"] = statistics.median(pairs)
    out["save() blocked the host (s)"] = statistics.median(blocked)
    out["pinned during a save / state"] = pinned / state_bytes
    out["pinned after close() (bytes)"] = float(arena.pinned_bytes)
    return out


def print_steps(results: dict[str, float], saves: int) -> None:
    print(f"\nsteps around async saves: median of {saves} saves, CUDA events")
    print(f"| {'measure':<48} | {'value':>9} |")
    print(f"|{'-' * 50}|{'-' * 11}|")
    for name, value in results.items():
        print(f"| {name:<48} | {value:9.4f} |")
    plain = results["plain step (s)"]
    print(
        f"| {'steps around a save / plain (target <= 1.5)':<48} | "
        f"{results['mean of the 2 steps around a save (s)'] / plain:9.3f} |"
    )
    print(
        f"| {'step right after save() / plain':<48} | {results['step right after save() (s)'] / plain:9.3f} |"
    )


RATIOS = [
    (
        "async blocked / sync save (target <= 0.05)",
        "vertexrt async save: caller blocked",
        "vertexrt sync save",
    ),
    ("floor (D2H+write) / sync save (target >= 0.9)", "floor: D2H + raw write + fsync", "vertexrt sync save"),
    ("torch.save / sync save (> 1: ahead)", "torch.save + fsync", "vertexrt sync save"),
    ("DCP save / sync save", "DCP save + fsync", "vertexrt sync save"),
    ("safetensors save / sync save", "safetensors save_file + fsync", "vertexrt sync save"),
    (
        "safetensors load_file(cuda) / restore (target >= 1.0)",
        "safetensors load_file(device=cuda)",
        "vertexrt restore into CUDA targets",
    ),
    ("torch.load / restore", "torch.load(map_location=cuda)", "vertexrt restore into CUDA targets"),
    ("DCP load / restore", "DCP load in place", "vertexrt restore into CUDA targets"),
]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, default=4.0, help="CUDA state size in GiB")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", default="/tmp/vertexrt-gpu-bench", help="local directory to write into")
    parser.add_argument("--step-gib", type=float, default=2.0, help="model + Adam state of the step table")
    parser.add_argument("--saves", type=int, default=5, help="async saves timed in the step table")
    parser.add_argument("--batch", type=int, default=2048, help="rows per training step in the step table")
    parser.add_argument("--only", choices=["io", "steps"], help="run one table only")
    args = parser.parse_args()
    try:
        import torch
    except ImportError:
        print("torch is not installed: nothing to measure")
        return 0
    if not torch.cuda.is_available():
        print("no CUDA device here: this benchmark needs a GPU (run it on the GPU machine)")
        return 0
    if args.only != "io":
        try:
            steps = step_rows(args.step_gib, args.saves, args.batch, args.dir)
        finally:
            shutil.rmtree(args.dir, ignore_errors=True)
        print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
        print_steps(steps, args.saves)
        torch.cuda.empty_cache()
    if args.only == "steps":
        return 0
    state = build_state(int(args.gib * (1 << 30)))
    try:
        results, total = rows(state, args.dir, args.repeats)
    finally:
        shutil.rmtree(args.dir, ignore_errors=True)
    gb = total / 1e9
    print(
        f"\n{torch.cuda.get_device_name()}: {total / (1 << 30):.2f} GiB in {len(flat(state))} CUDA tensors, "
        f"median of {args.repeats}, torch {torch.__version__}"
    )
    print(f"| {'operation':<48} | {'s':>7} | {'GB/s':>6} |")
    print(f"|{'-' * 50}|{'-' * 9}|{'-' * 8}|")
    for name, seconds in results.items():
        print(f"| {name:<48} | {seconds:7.3f} | {gb / seconds:6.1f} |")
    print(f"\n| {'ratio':<56} | {'value':>6} |")
    print(f"|{'-' * 58}|{'-' * 8}|")
    for label, num, den in RATIOS:
        if num in results and den in results:
            print(f"| {label:<56} | {results[num] / results[den]:6.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())

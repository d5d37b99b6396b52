"""One rank of ``benchmarks/recovery.py``: a data-parallel loop with a durable tier and (optionally) a fast
tier, each rank with its own local directory ("VM"), its reader position and a state of ``mib`` MiB.

Usage: python recovery_worker.py RANK WORLD PORT CONFIG_JSON
CONFIG keys: durable, local_root, total, durable_every, fast_every (0: no fast tier), mib, step_seconds,
die_at (rank 1 SIGKILLs itself after that step's save, -1: never), term_at (rank 1 SIGTERMs itself after
that step, -1: never; it writes ``marker`` first, with the newest durable step), report (a JSON file).
The report holds the step resumed from, seconds from the launch (``launched_at``) to the end of the first
step, and the seconds ``save()`` blocked per step.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import time
import traceback

VICTIM = 1


def main(rank: int, world: int, port: int, cfg: dict) -> int:
    import torch
    import torch.distributed as dist

    from vertexrt.checkpoint import CheckpointManager, EveryNSteps, FastTier

    cfg["report"] = cfg["report"].format(rank=rank)
    logging.basicConfig(level=logging.INFO, format=f"%(relativeCreated)d rank {rank}: %(name)s: %(message)s")
    os.environ["VERTEXRT_LOCAL_CHECKPOINT_DIR"] = os.path.join(cfg["local_root"], f"replica{rank}")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    gen = torch.Generator().manual_seed(rank)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    blob = torch.rand(max(1, cfg["mib"] << 18), generator=gen)  # mib MiB of float32: the bulk of the state
    state = {"model": model, "opt": opt, "blob": blob, "position": 0, "step": -1}
    fast = cfg["fast_every"]
    mgr = CheckpointManager(
        cfg["durable"],
        save_policy=EveryNSteps(cfg["durable_every"]),
        fast=FastTier(every=EveryNSteps(fast), peers=1) if fast else None,
        save_on_preemption=cfg["term_at"] >= 0,
    )
    restored = mgr.restore(target=state)
    start = restored["step"] + 1 if restored else 0
    report: dict = {"resumed": mgr.restored_step, "blocked": {}}
    for step in range(start, cfg["total"]):
        time.sleep(cfg["step_seconds"])  # the accelerator's share of the step
        x = torch.randn(8, 4, generator=gen)
        loss = ((model(x) - x.sum(dim=1, keepdim=True)) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        for p in model.parameters():
            dist.all_reduce(p.grad)
        opt.step()
        state["step"], state["position"] = step, step + 1
        began = time.perf_counter()
        mgr.save(step, state, shard=rank)
        report["blocked"][step] = time.perf_counter() - began
        if step == start:
            report["first_step_s"] = time.time() - cfg["launched_at"]
        if rank == VICTIM and step == cfg["die_at"]:
            _write(cfg["report"], report)
            os.kill(os.getpid(), signal.SIGKILL)
        if cfg["term_at"] >= 0:
            if rank == VICTIM and step == cfg["term_at"]:
                _write(cfg["marker"], {"durable": max(mgr.all_steps(), default=None), "at": time.time()})
                os.kill(os.getpid(), signal.SIGTERM)
            stop = mgr.preemption_requested()
            while step == cfg["total"] - 1 and cfg["term_at"] < step and not stop:
                time.sleep(0.01)  # the ranks agree on the notice before the run ends
                stop = mgr.preemption_requested()
            if stop:
                report["stopped"] = step
                _write(cfg["report"], report)  # the grace may end before the emergency save does
                report["durable_saved"] = mgr.save(step, state, force=True, shard=rank)
                mgr.close()
                report["stop_s"] = time.time()
                _write(cfg["report"], report)
                return 143
    mgr.close()
    _write(cfg["report"], report)
    dist.destroy_process_group()
    return 0


def _write(path: str, data: dict) -> None:
    with open(path + ".tmp", "w") as f:
        json.dump(data, f)
    os.replace(path + ".tmp", path)


if __name__ == "__main__":
    code = 1
    try:
        a = sys.argv[1:]
        code = main(int(a[0]), int(a[1]), int(a[2]), json.loads(a[3]))
    except BaseException:
        traceback.print_exc()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # torch's gloo teardown sometimes aborts the interpreter's exit

"""One rank of ``benchmarks/recovery.py``: a data-parallel loop with a durable tier and (optionally) a fast
tier, each rank with its own local directory ("VM"), its reader position and a state of ``mib`` MiB.

Usage: python recovery_worker.py RANK WORLD PORT CONFIG_JSON, or ``--fork-server`` (see :func:`fork_server`)
CONFIG keys: durable, local_root, total, durable_every, fast_every (0: no fast tier), mib, step_seconds,
die_at (rank 1 SIGKILLs itself after that step's save, -1: never), term_at (rank 1 SIGTERMs itself after
that step, -1: never; it writes ``marker`` first, with the newest durable step), term_after (instead of
term_at: that many steps after the step resumed from), report (a JSON file).
The report holds the step resumed from, seconds from the launch (``launched_at``) to the end of the first
step, when the start-up phases ended (``began``: process group, manager, restore), the seconds ``save()``
blocked per step, the steps whose ``save()`` wrote a durable step, and after a preemption notice the step
stopped at and when the emergency save began (``stop_began``) and ended.
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
    began = {"start": time.time()}
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    began["group"] = time.time()
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
        save_on_preemption=cfg["term_at"] >= 0 or cfg.get("term_after") is not None,
    )
    began["manager"] = time.time()
    restored = mgr.restore(target=state)
    began["restored"] = time.time()
    start = restored["step"] + 1 if restored else 0
    if cfg.get("term_after") is not None:
        cfg["term_at"] = start + cfg["term_after"]
    report: dict = {"resumed": mgr.restored_step, "blocked": {}, "durable_steps": [], "began": began}
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
        if mgr.save(step, state, shard=rank):
            report["durable_steps"].append(step)
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
                report["stopped"], report["stop_began"] = step, time.time()
                _write(cfg["report"], report)  # the grace may end before the emergency save does
                if step in report["durable_steps"]:  # this step's save was durable: it is the emergency one
                    mgr.wait()
                    report["durable_saved"] = True
                else:
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


def fork_server() -> None:
    """``--fork-server``: import torch and vertexrt once, then answer one request per stdin line (JSON):
    ``{"rank", "world", "port", "cfg", "log"}`` forks a rank (answers its pid); ``{"code", "args",
    "out", "log"}`` forks ``python -c code args`` likewise; ``{"poll": pid}`` answers its exit code
    (null: still running), ``{"wait": pid}`` waits for it. The durability check launches its rounds
    through it: a fresh interpreter importing torch costs seconds a round on a loaded machine; a fork,
    milliseconds."""
    import importlib
    import pkgutil

    import gcsfs  # noqa: F401
    import torch.distributed
    import torch.distributed.tensor  # noqa: F401 (the first save() asks whether the state holds DTensors)

    for package in ("checkpoint", "distributed", "preemption"):  # imported once, not compiled by every rank
        root = importlib.import_module(f"vertexrt.{package}")
        for module in pkgutil.walk_packages(root.__path__, f"vertexrt.{package}."):
            importlib.import_module(module.name)
    for name in ("paths", "clients", "retries", "phases", "audit", "emulator"):
        importlib.import_module(f"vertexrt.{name}")

    for line in sys.stdin:
        request = json.loads(line)
        if "poll" in request or "wait" in request:
            pid = request.get("poll", request.get("wait"))
            done, status = os.waitpid(pid, os.WNOHANG if "poll" in request else 0)
            answer = os.waitstatus_to_exitcode(status) if done else None
        else:
            answer = _fork(request)
        print(json.dumps(answer), flush=True)


def _fork(request: dict) -> int:
    """Fork the rank or the code ``request`` names: stdout to ``request["out"]`` (if given), stderr to
    ``request["log"]``."""
    pid = os.fork()
    if pid:
        return pid
    code = 1
    try:
        os.dup2(os.open(os.devnull, os.O_RDWR), 0)
        for fd, name in ((1, request.get("out", os.devnull)), (2, request["log"])):
            os.dup2(os.open(name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644), fd)
        if "code" in request:
            sys.argv = ["-c", *request["args"]]
            exec(request["code"], {"__name__": "__main__"})
            code = 0
        else:
            code = main(request["rank"], request["world"], request["port"], request["cfg"])
    except BaseException:
        traceback.print_exc()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    if sys.argv[1:] == ["--fork-server"]:
        fork_server()
        sys.exit(0)
    code = 1
    try:
        a = sys.argv[1:]
        code = main(int(a[0]), int(a[1]), int(a[2]), json.loads(a[3]))
    except BaseException:
        traceback.print_exc()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # torch's gloo teardown sometimes aborts the interpreter's exit

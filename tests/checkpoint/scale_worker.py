"""One rank of the checkpoint scale tests: each phase's storage requests go through a counting proxy of its
own (one gcsfs client per endpoint).

Usage: python scale_worker.py RANK WORLD PORT ROOT PHASE=ENDPOINT..., phases run in order: ``save`` (a
sharded step 1), ``restore`` (the newest step), ``exists`` (saving step 1 again) and ``fallback`` (steps 1
and 2; rank 1's data of step 2 damaged; every rank restores step 1), ``bodies`` (steps 1 to 3; rank 1's body
file of step 3 damaged and of step 2 removed; every rank restores step 1) and ``v1`` (step 1 rewritten in
format version 1, every body inline, as vertexrt wrote it before body files; every rank restores it).
Prints a JSON report per phase last.
"""

from __future__ import annotations

import json
import os
import sys


def state(rank: int) -> dict:
    import numpy as np

    return {
        "rank": rank,
        "w": np.arange(64, dtype=np.int64) * (rank + 1),
        "names": [f"leaf{i}" for i in range(8)],
    }


def main(rank: int, world: int, port: int, root: str, phases: list[str]) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    report: dict = {}
    for phase, _, endpoint in (p.partition("=") for p in phases):
        os.environ["STORAGE_EMULATOR_HOST"] = endpoint  # this phase's requests: its own counting proxy
        report[phase] = run_phase(phase, rank, root, dist)
        dist.barrier()
    dist.destroy_process_group()
    print(json.dumps(report), flush=True)


def run_phase(phase: str, rank: int, root: str, dist) -> object:
    from vertexrt.checkpoint import CheckpointManager
    from vertexrt.errors import StepExistsError

    outcome: object = None
    with CheckpointManager(root) as mgr:
        if phase == "save":
            assert mgr.save(1, state(rank), shard=rank)
        elif phase == "restore":
            outcome = int(mgr.restore()["rank"])
        elif phase == "exists":
            try:
                mgr.save(1, state(rank), shard=rank)
                mgr.wait()
            except StepExistsError as exc:
                outcome = type(exc).__name__
        elif phase == "fallback":
            for step in (1, 2):
                mgr.save(step, {**state(rank), "step": step}, shard=rank)
                mgr.wait()
            dist.barrier()
            if rank == 1:
                from vertexrt import paths

                fs, path = paths.filesystem(f"{root}/step_{2:010d}")
                mine = [f for f in fs.ls(path, refresh=True) if ".s1." in f.rsplit("/", 1)[-1]]
                data = bytearray(fs.cat_file(mine[0]))
                data[-1] ^= 0xFF
                fs.pipe_file(mine[0], bytes(data))
            dist.barrier()
            got = mgr.restore()
            outcome = [int(got["step"]), int(got["rank"])]
        elif phase == "bodies":
            for step in (1, 2, 3):
                mgr.save(step, {**state(rank), "step": step}, shard=rank)
                mgr.wait()
            dist.barrier()
            if rank == 1:
                damage_body(root, 3, lambda fs, path: fs.pipe_file(path, fs.cat_file(path)[:-1] + b" "))
                damage_body(root, 2, lambda fs, path: fs.rm_file(path))
            dist.barrier()
            got = mgr.restore()
            outcome = [int(got["step"]), int(got["rank"])]
        elif phase == "v1":
            mgr.save(1, state(rank), shard=rank)
            mgr.wait()
            dist.barrier()
            if rank == 0:
                rewrite_as_v1(root, 1)
            dist.barrier()
            with CheckpointManager(root) as fresh:
                outcome = [int(fresh.restore()["rank"]), fresh.restored_step]
    return outcome


def damage_body(root: str, step: int, damage) -> None:
    """``damage(fs, path)`` rank 1's body file of ``step``."""
    from vertexrt import paths

    fs, path = paths.filesystem(f"{root}/step_{step:010d}")
    (body,) = [f for f in fs.ls(path, refresh=True) if f.endswith(".s1.body.json")]
    damage(fs, body)


def rewrite_as_v1(root: str, step: int) -> None:
    """Step ``step`` as format version 1 wrote it: one manifest with every body inline, no body files."""
    from vertexrt import paths
    from vertexrt.checkpoint import manifest

    fs, path = paths.filesystem(f"{root}/step_{step:010d}")
    header = json.loads(fs.cat_file(f"{path}/manifest.json"))
    assert header["format_version"] == 2 and all("tree" not in e for e in header["shards"]), header
    bodies = [json.loads(fs.cat_file(f"{path}/{e['body']['name']}")) for e in header["shards"]]
    old = manifest.build(
        step=step, world_size=header["world_size"], sharded=True, shards=bodies, metrics=header["metrics"]
    )
    assert old["format_version"] == 1, old
    for entry in header["shards"]:
        fs.rm_file(f"{path}/{entry['body']['name']}")
    fs.pipe_file(f"{path}/manifest.json", manifest.dumps(old))


if __name__ == "__main__":
    from rank_exit import exit_after

    exit_after(lambda: main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5:]))

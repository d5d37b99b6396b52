"""Tamper with a real checkpoint's manifest at random and check restore() always falls back cleanly.

Each round writes one random change into the newest step's manifest (a digit of a shape or size, a wrong
type, a missing key, a huge count, deep nesting, a ``../`` or absolute file name, a symlink or FIFO in place
of a data file), then restores. Every round must end in the previous step (or in the newest one, when the
change still fits the schema, e.g. another value), with no exception but vertexrt's and no file opened
outside the directory. A format_version raised above this vertexrt's is the one deliberate exception: it is
reported ("upgrade vertexrt"), not skipped, so a newer writer's step is never passed over silently.

Run: .venv/bin/python scripts/fuzz_manifest.py [--rounds 300] [--seed 1]
Prints e.g. ``300 rounds: 0 raw errors, 0 reads outside, 0 without fallback`` and exits 1 on any failure.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import random
import shutil
import sys
import tempfile
from typing import Any

_OPENED: list[str] = []
_WATCH = [False]


def _audit(event: str, args: tuple[Any, ...]) -> None:
    if _WATCH[0] and event == "open" and isinstance(args[0], (str, bytes, os.PathLike)):
        _OPENED.append(os.path.abspath(os.fsdecode(args[0])))


def state(step: int) -> dict[str, Any]:
    import numpy as np
    import torch

    return {
        "step": step,
        "w": torch.arange(1000, dtype=torch.float32) * step,
        "opt": {"m": np.full((7, 3), step, dtype=np.float64), 3: [1, 2.5, None, b"xy"]},
        "big": 2**80 + step,
    }


def _paths(value: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    out = [prefix]
    if isinstance(value, dict):
        for key, item in value.items():
            out += _paths(item, (*prefix, key))
    elif isinstance(value, list):
        for i, item in enumerate(value):
            out += _paths(item, (*prefix, i))
    return out


def _set(doc: Any, where: tuple[Any, ...], value: Any, delete: bool = False) -> None:
    for key in where[:-1]:
        doc = doc[key]
    if delete:
        del doc[where[-1]]
    else:
        doc[where[-1]] = value


def _get(doc: Any, where: tuple[Any, ...]) -> Any:
    for key in where:
        doc = doc[key]
    return doc


def tamper(doc: dict[str, Any], rng: random.Random, step_dir: str) -> tuple[dict[str, Any] | bytes, str]:
    """One random change; returns the new manifest (or raw bytes) and what was done."""
    doc = copy.deepcopy(doc)
    places = [p for p in _paths(doc) if p]
    where = rng.choice(places)
    old = _get(doc, where)
    kind = rng.choice(["digit", "type", "delete", "huge", "negative", "name", "deep", "special", "raw"])
    if kind == "digit" and isinstance(old, int) and not isinstance(old, bool):
        _set(doc, where, old + rng.choice([-1, 1, 10]))
    elif kind == "type":
        _set(doc, where, rng.choice([None, "x", 1.5, [], {}, True, [1, 2]]))
    elif kind == "delete" and len(where) >= 1 and isinstance(_get(doc, where[:-1]), dict):
        _set(doc, where, None, delete=True)
    elif kind == "huge":
        _set(doc, where, rng.choice([2**62, 10**30, [0] * 100_000, "9" * 5000]))
    elif kind == "negative":
        _set(doc, where, -rng.randint(1, 10**9))
    elif kind == "name":
        bad = rng.choice(["../../outside", "/etc/passwd", "..", "a/../../b", "/tmp"])
        body = doc["shards"][0]
        if rng.random() < 0.5:
            body["prefix"] = bad
        else:
            name, size = next(iter(body["files"].items()))
            body["files"] = {bad: size, **{k: v for k, v in body["files"].items() if k != name}}
    elif kind == "deep":
        depth = rng.choice([300, 5000, 100_000])
        _set(doc, where, "@DEEP@")
        nested = '{"t": "list", "v": [' * depth + "1" + "]}" * depth
        return json.dumps(doc).replace('"@DEEP@"', nested).encode(), f"{depth} levels at {where}"
    elif kind == "special":
        data = [n for n in os.listdir(step_dir) if n.startswith("data.")]
        victim = os.path.join(step_dir, rng.choice(data))
        os.remove(victim)
        if rng.random() < 0.5:
            os.symlink("/etc/passwd", victim)
        else:
            os.mkfifo(victim)
        return doc, f"special file at {os.path.basename(victim)}"
    else:
        raw = json.dumps(doc).encode()
        cut = rng.randrange(len(raw))
        return raw[:cut] + bytes([rng.randrange(256)]) + raw[cut + 1 :], f"byte {cut}"
    return doc, f"{kind} at {where}"


def run(rounds: int, seed: int) -> dict[str, int]:
    import logging

    import vertexrt
    from vertexrt.checkpoint import CheckpointManager
    from vertexrt.errors import VertexrtError

    code = os.path.dirname(os.path.abspath(vertexrt.__file__)) + os.sep

    logging.disable(logging.WARNING)
    sys.addaudithook(_audit)
    rng = random.Random(seed)
    base = tempfile.mkdtemp(prefix="vertexrt-fuzz-")
    pristine = os.path.join(base, "pristine")
    with CheckpointManager(pristine, async_save=False, allow_pickle=False) as mgr:
        mgr.save(1, state(1))
        mgr.save(2, state(2))
    with open(os.path.join(pristine, "step_0000000002", "manifest.json")) as f:
        manifest = json.load(f)
    results = {"rounds": 0, "raw errors": 0, "reads outside": 0, "without fallback": 0}
    try:
        for i in range(rounds):
            root = os.path.join(base, f"r{i}")
            shutil.copytree(pristine, root, symlinks=True)
            step_dir = os.path.join(root, "step_0000000002")
            new, what = tamper(manifest, rng, step_dir)
            with open(os.path.join(step_dir, "manifest.json"), "wb") as f:
                f.write(new if isinstance(new, bytes) else json.dumps(new).encode())
            _OPENED.clear()
            _WATCH[0] = True
            try:
                with CheckpointManager(root) as mgr:
                    got = mgr.restore()
                    restored = mgr.restored_step
            except VertexrtError as exc:
                got, restored = None, None
                if "format_version" in what and "upgrade vertexrt" in str(exc):
                    restored = "newer format"  # deliberate: a newer writer's step is not skipped silently
                print(f"round {i} ({what}): {type(exc).__name__}: {str(exc)[:200]}")
            except BaseException as exc:  # noqa: BLE001 - what this fuzzer counts
                got, restored = None, None
                results["raw errors"] += 1
                print(f"round {i} ({what}): RAW {type(exc).__name__}: {str(exc)[:200]}")
            finally:
                _WATCH[0] = False
            outside = [p for p in _OPENED if not p.startswith(root + os.sep) and "site-packages" not in p]
            outside = [p for p in outside if not p.startswith(code)]  # vertexrt modules imported lazily
            outside = [
                p for p in outside if not p.startswith(("/proc/", "/sys/", "/dev/urandom", sys.prefix))
            ]
            if outside:
                results["reads outside"] += 1
                print(f"round {i} ({what}): opened outside {outside[:3]}")
            if restored == 1:
                import torch

                if not torch.equal(got["w"], state(1)["w"]):
                    results["without fallback"] += 1
                    print(f"round {i} ({what}): step 1 restored wrong values")
            elif restored not in (2, "newer format"):  # 2: the change was consistent with the schema
                results["without fallback"] += 1
                print(f"round {i} ({what}): no fallback (restored {restored})")
            results["rounds"] += 1
            shutil.rmtree(root, ignore_errors=True)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=300)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    results = run(args.rounds, args.seed)
    print(
        f"{results['rounds']} rounds: {results['raw errors']} raw errors, {results['reads outside']} reads "
        f"outside, {results['without fallback']} without fallback"
    )
    return 1 if results["raw errors"] or results["reads outside"] or results["without fallback"] else 0


if __name__ == "__main__":
    sys.exit(main())

"""On a GPU machine: ``init_torch`` binds NCCL to this process's GPU (no "Guessing device ID" warning).

One process, world of 1, ``MASTER_ADDR``/``MASTER_PORT`` on loopback: ``init_torch(backend="nccl")``, an
``all_reduce`` and a ``barrier`` on CUDA. Prints one JSON line: the device, the value, and whether NCCL or
torch warned about guessing the device. Exit status 1 when it did (or no GPU is visible).

Example:
    $ PYTHONPATH=src python3 scripts/gpu_check.py
    {"device": "cuda:0", "sum": 1.0, "guessed_device": false, ...}
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import warnings

GUESS = ("Guessing device ID", "device under current context")


def main() -> int:
    import torch

    if not torch.cuda.is_available():
        print(json.dumps({"error": "no GPU visible"}))
        return 1
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29517", WORLD_SIZE="1", RANK="0")
    from vertexrt.distributed import init_torch

    with tempfile.TemporaryFile() as captured:
        saved = os.dup(2)
        os.dup2(captured.fileno(), 2)  # NCCL and c10 warn on the C++ side, into fd 2
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                handle = init_torch(backend="nccl")
                value = torch.ones(1, device=handle.device)
                torch.distributed.all_reduce(value)
                torch.distributed.barrier()
                torch.cuda.synchronize()
                total = value.item()
                handle.shutdown()
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
        captured.seek(0)
        stderr = captured.read().decode(errors="replace")
    messages = [str(w.message) for w in caught] + stderr.splitlines()
    guessed = [m for m in messages if any(g in m for g in GUESS)]
    report = {
        "device": str(handle.device),
        "current_device": torch.cuda.current_device(),
        "backend": handle.backend,
        "sum": total,
        "guessed_device": bool(guessed),
        "warnings": guessed or messages[-5:],
        "torch": torch.__version__,
        "nccl": ".".join(map(str, torch.cuda.nccl.version())),
    }
    print(json.dumps(report))
    return 1 if guessed else 0


if __name__ == "__main__":
    sys.exit(main())

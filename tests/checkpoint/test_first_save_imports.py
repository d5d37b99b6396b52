"""A save of plain tensors imports no more of torch than it needs.

``torch.distributed.tensor`` (and sympy under it) costs seconds to import on a loaded VM; a state can only
hold a DTensor once that module was imported, so a first save (and the time to the first step after every
restart) must not pay for it.
"""

from __future__ import annotations

import sys

from jobs import run_job

PROGRAM = """
import sys, torch
from vertexrt.checkpoint import CheckpointManager
with CheckpointManager(sys.argv[1], rank=0, world_size=1) as mgr:
    mgr.save(0, {"model": torch.nn.Linear(2, 2), "x": torch.zeros(3)})
    mgr.restore(target={"model": torch.nn.Linear(2, 2), "x": torch.zeros(3)})
print("loaded:", "torch.distributed.tensor" in sys.modules)
"""


def test_a_save_and_restore_of_plain_tensors_does_not_import_torch_distributed_tensor(tmp_path) -> None:
    result = run_job([sys.executable, "-c", PROGRAM, str(tmp_path / "ckpt")], None, timeout=120)
    assert result.returncode == 0, result.stdout
    assert "loaded: False" in result.stdout

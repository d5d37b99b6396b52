"""The checkpoint manager's collectives run on the gloo side group, never on the default (GPU) group.

Two real processes whose default group is a separate, non-gloo group that refuses every collective (as
NCCL would make the host wait for the GPU on each): broadcasts, maxima, gathers and a save/restore cycle.
"""

from __future__ import annotations

from .ckpt_helpers import assert_every_rank_ok, run_ranks


def test_checkpoint_collectives_use_the_cpu_side_group_not_the_default_group(tmp_path):
    results = run_ranks(
        "collective_worker.py", 2, lambda rank, port: [str(rank), "2", str(port), str(tmp_path)]
    )
    assert_every_rank_ok(results, "collective groups")

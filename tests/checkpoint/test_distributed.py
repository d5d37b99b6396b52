"""Two real gloo processes: chief-only writes, per-rank shards, one commit, agreed decisions."""

from __future__ import annotations

import pytest

from .ckpt_helpers import run_ranks


def _run_ranks(script: str, root: str, world: int = 2) -> list[tuple[int, str, str]]:
    """``script rank world port root`` as ``world`` real processes."""
    return run_ranks(script, world, lambda rank, port: [str(rank), str(world), str(port), root])


@pytest.mark.slow
def test_two_gloo_ranks_save_and_restore(storage_root):
    for rank, (code, out, err) in enumerate(_run_ranks("dist_worker.py", storage_root)):
        assert code == 0 and out.strip() == "OK", f"rank {rank} failed:\n{err[-3000:]}"


@pytest.mark.slow
def test_ranks_agree_on_saves_restores_and_world_size(tmp_path):
    import json

    reports = []
    for rank, (code, out, err) in enumerate(_run_ranks("agree_worker.py", str(tmp_path))):
        assert code == 0, f"rank {rank} failed:\n{err[-3000:]}"
        reports.append(json.loads(out.strip().splitlines()[-1]))
    chief, other = reports
    # rank 0's clock was due from steps 3 and 57 on: every rank saves at the same (slightly later) step
    assert chief["saved"] == other["saved"] and len(chief["saved"]) == 2, reports
    assert 3 <= chief["saved"][0] <= 3 + 20 and 57 <= chief["saved"][1] <= 57 + 20, reports
    for report in reports:
        counts = report["collectives"]
        assert counts["broadcast_object_list"] == 0, counts  # no pickled broadcast per save() call
        assert counts["broadcast"] <= 200 // 10 + 1 and counts["all_reduce"] == 0, counts
    assert chief["restored"] == [1, 10.0] and other["restored"] == [1, 11.0], reports
    for report in reports:
        assert report["world_error"] and "written by 1 ranks" in report["world_error"], reports


@pytest.mark.slow
def test_a_read_error_on_one_rank_stops_every_rank_with_a_checkpoint_error(tmp_path):
    import json

    reports = []
    for rank, (code, out, err) in enumerate(_run_ranks("agree_oserror_worker.py", str(tmp_path))):
        assert code == 0, f"rank {rank} failed:\n{err[-3000:]}"
        reports.append(json.loads(out.strip().splitlines()[-1]))
    chief, other = reports
    # rank 1 cannot read the step (EIO): it says so, and rank 0 is not left waiting in the agreement
    assert other["type"] == "CheckpointError" and "Input/output error" in other["message"], reports
    assert "step 1" in other["message"], reports
    assert chief["type"] == "CheckpointError" and "another rank" in chief["message"], reports

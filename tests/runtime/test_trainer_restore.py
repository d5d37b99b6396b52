"""Storage requests of a multi-replica Trainer's restore (real gloo ranks, the GCS server behind one counting
proxy per rank and phase): rank 0 alone lists and reads the manifest. Deterministic counts, never timings."""

from __future__ import annotations

import json
import os
import uuid
from typing import Any

import pytest
from faultproxy import FaultProxy
from jobs import run_ranks

WORKER = os.path.join(os.path.dirname(__file__), "scripts", "trainer_restore_worker.py")


def _restore_requests(gcs_server: Any, tmp_path: Any, world: int) -> tuple[list[list[str]], list[Any]]:
    """Each rank's request lines of the second fit() (a restore of the first one's step 4), and reports."""
    root = f"gs://vertexrt-test/{uuid.uuid4().hex}/ckpt"
    phases = [[FaultProxy(("127.0.0.1", gcs_server.port)).start() for _ in range(world)] for _ in range(2)]
    train, restore = phases
    try:
        results = run_ranks(
            WORKER,
            world,
            lambda rank, port: [
                *(str(rank), str(world), str(port), root, str(tmp_path)),
                *(train[rank].endpoint, restore[rank].endpoint),
            ],
        )
        for rank, (code, _, err) in enumerate(results):
            assert code == 0, f"rank {rank} of {world}:\n{err[-4000:]}"
        reports = [json.loads(out.strip().splitlines()[-1]) for _, out, _ in results]
        return [[line for line, _ in proxy.forwarded] for proxy in restore], reports
    finally:
        for proxy in (*train, *restore):
            proxy.stop()


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 3])
def test_only_rank_0_lists_and_reads_the_manifest_when_a_trainer_restores(
    gcs_server: Any, tmp_path: Any, world: int
) -> None:
    requests, reports = _restore_requests(gcs_server, tmp_path, world)
    assert [r["step"] for r in reports] == [4] * world
    assert all(r["weights"] == reports[0]["weights"] for r in reports)
    assert any("manifest.json" in line for line in requests[0])  # the chief reads it (and lists)
    for rank, lines in enumerate(requests[1:], start=1):  # the others: shard 0's and their own, only:
        # each shard's body file (format version 2) and its data file, one request each
        assert all(line.startswith("GET /download/") for line in lines), (rank, lines)
        assert sorted(".body.json?" in line for line in lines) == [False, False, True, True], (rank, lines)
        assert sum(".bin?" in line for line in lines) == 2, (rank, lines)
        assert not any("manifest.json" in line for line in lines), (rank, lines)


FAST_WORKER = os.path.join(os.path.dirname(__file__), "scripts", "trainer_fast_worker.py")


def _fast_run(root: Any, die_at: int) -> list[tuple[int, str, str]]:
    return run_ranks(FAST_WORKER, 2, lambda rank, port: [str(rank), "2", str(port), str(root), str(die_at)])


@pytest.mark.slow
def test_a_killed_trainer_resumes_from_its_fast_tier_with_the_weights_of_an_uninterrupted_run(
    tmp_path: Any,
) -> None:
    """Fast steps every 2, durable every 5: killed at step 8, the job resumes from fast step 8 (the newest
    durable step is 5) and ends where an uninterrupted run ends."""
    killed = _fast_run(tmp_path / "run", die_at=8)
    assert [code for code, _, _ in killed] == [-9, -9], [err[-3000:] for _, _, err in killed]
    reports = []
    for root in (tmp_path / "reference", tmp_path / "run"):
        results = _fast_run(root, die_at=-1)
        for code, _, _ in results:
            assert code == 0, "\n".join(err[-3000:] for _, _, err in results)
        reports.append([json.loads(out.strip().splitlines()[-1]) for _, out, _ in results])
    uninterrupted, resumed = reports
    assert [r["started_at"] for r in resumed] == [8, 8]  # the fast step, newer than durable step 5
    assert sorted(os.listdir(tmp_path / "run" / "ckpt"))[:2] == ["step_0000000005", "step_0000000010"]
    assert [r["weights"] for r in resumed] == [r["weights"] for r in uninterrupted]

"""The durability of the emergency save: hard kills at random moments after SIGTERM, with a throttled server.

Two real gloo ranks (``benchmarks/recovery_worker.py``, forked from one interpreter) with a fast tier and a
durable tier on the GCS test server behind a throttling relay; rank 1 gets SIGTERM at a seeded random step,
and at a seeded random moment within the grace every rank is SIGKILLed. After each kill, every committed
durable step restores and verifies on every rank's shard (0 partially visible steps), and the newest durable
step is not older than before the signal.
The benchmark runs the same check with ``--kills 200``.
"""

from __future__ import annotations

import argparse
import os
import sys

import pytest

BENCHMARKS = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(__file__))), "benchmarks")
KILLS = 3  # seeded moments; the benchmark runs 200 (each round forks 2 ranks and a check: ~15 s loaded)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_hard_kills_during_an_emergency_save_leave_no_partial_durable_step(gcs_server, tmp_path):
    sys.path.insert(0, BENCHMARKS)
    try:
        import recovery
    finally:
        sys.path.remove(BENCHMARKS)
    gcs_server.make_bucket(recovery.BUCKET)
    relay = recovery.ThrottledRelay(("127.0.0.1", gcs_server.port))
    args = argparse.Namespace(
        mib=1, step_ms=20.0, fast_every=2, durable_every=4, die_at=10, grace=4.0,
        throttle_mbs=1.0, kill_window=None, seed=1,
    )  # fmt: skip
    try:
        checked = recovery.durability(recovery.Bench(args, str(tmp_path), relay), KILLS, ranks=2)
    finally:
        relay.close()
    assert checked["failures"] == []
    assert (checked["kills"], checked["partial"], checked["regressions"]) == (KILLS, 0, 0)
    assert checked["steps_verified"] >= KILLS  # a durable step existed before every signal, and was read

"""Rank 0's fast-tier state reaches the ranks that ask for it as raw bytes, not as one pickled object.

Two real gloo ranks (``fast_broadcast_worker.py``): the Trainer's restore shape, where rank 1 takes rank 0's
replicated state beside its own. Counted while ``restore_fast_shards`` runs: the bytes pickled through the
object broadcast (a few KB for a 16 MiB state) and the bytes sent as uint8 tensors (the state itself).
"""

from __future__ import annotations

import json

import pytest

from .ckpt_helpers import assert_every_rank_ok, run_ranks

STATE_BYTES = 16 << 20


@pytest.fixture(scope="module")
def counts(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    root = tmp_path_factory.mktemp("fast_broadcast")
    results = run_ranks(
        "fast_broadcast_worker.py", 2, lambda rank, port: [str(rank), "2", str(port), str(root)]
    )
    assert_every_rank_ok(results, "fast broadcast")
    return [json.loads(out.strip().splitlines()[-2]) for _, out, _ in results]


def test_broadcast_bytes_sends_rank_0s_buffers_bit_for_bit_in_bounded_runs(counts):
    # sizes [0, 10, 999, 1000, 2500, 3, 0] in runs of <= 1000 bytes: [0, 10] [999] [1000] [2500] [3, 0]
    assert [c["runs"] for c in counts] == [[10, 999, 1000, 2500, 3]] * 2


def test_the_fast_restore_sends_rank_0s_state_as_raw_bytes_beside_a_small_header(counts):
    chief = counts[0]
    assert len(chief["objects"]) == 1 and chief["objects"][0] < 8 << 10, chief["objects"]
    for rank, c in enumerate(counts):
        assert sum(c["tensors"]) >= STATE_BYTES, f"rank {rank}: {c['tensors']}"

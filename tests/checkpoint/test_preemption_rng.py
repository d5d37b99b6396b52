"""The SIGTERM flag handler, and RNG state captured and restored with the checkpoint."""

from __future__ import annotations

import os
import random
import signal

import numpy as np
import torch

from vertexrt.checkpoint import PREEMPTED_EXIT_CODE, CheckpointManager, rng_state


def test_sigterm_only_sets_a_flag_and_chains_the_previous_handler(tmp_path):
    seen = []
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: seen.append(signum))
    try:
        mgr = CheckpointManager(str(tmp_path), save_on_preemption=True)
        assert mgr.preemption_requested() is False
        os.kill(os.getpid(), signal.SIGTERM)
        assert mgr.preemption_requested() is True
        assert seen == [signal.SIGTERM]
        assert mgr.save(5, {"w": np.ones(3)}, force=True)
        assert mgr._pending is None  # synchronous once preemption is requested
        assert mgr.all_steps() == [5]
        mgr.close()
        os.kill(os.getpid(), signal.SIGTERM)  # the previous handler is back in place
        assert seen == [signal.SIGTERM, signal.SIGTERM]
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert PREEMPTED_EXIT_CODE == 143


def test_rng_state_round_trip(tmp_path):
    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    with CheckpointManager(str(tmp_path), async_save=False) as mgr:
        mgr.save(1, {"rng": rng_state()})
        expected = (random.random(), np.random.rand(3), torch.rand(3))
        random.seed(99)
        np.random.seed(99)
        torch.manual_seed(99)
        mgr.restore(target={"rng": rng_state()})
    got = (random.random(), np.random.rand(3), torch.rand(3))
    assert got[0] == expected[0]
    np.testing.assert_array_equal(got[1], expected[1])
    assert torch.equal(got[2], expected[2])

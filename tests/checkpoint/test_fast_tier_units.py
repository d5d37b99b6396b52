"""The fast tier's pieces in one process: the peer ring, the restore plan, the grace sizing, the local
steps (partial and damaged ones), the configuration, and a one-rank manager with a fast tier."""

from __future__ import annotations

import logging
import os
import signal
import tempfile

import pytest

from vertexrt.checkpoint import CheckpointManager, EveryNSteps, FastTier
from vertexrt.checkpoint.tiers import config, grace
from vertexrt.checkpoint.tiers.local import LocalSteps
from vertexrt.checkpoint.tiers.peers import PeerRing
from vertexrt.checkpoint.tiers.plan import Inventory, plan
from vertexrt.errors import ConfigError
from vertexrt.preemption.signals import preemption_signal

from .ckpt_helpers import assert_state_equal, make_state


def test_copies_go_to_the_same_local_rank_on_the_next_vms():
    ring = PeerRing(rank=1, world_size=6, local_world_size=2, peers=1)  # 3 VMs of 2 ranks
    assert (ring.targets(), ring.sources()) == ([3], [5])
    two = PeerRing(rank=4, world_size=6, local_world_size=2, peers=2)
    assert (two.targets(), two.sources()) == ([0, 2], [2, 0])
    assert PeerRing(rank=0, world_size=2, local_world_size=2, peers=1).targets() == []  # one VM: no peer
    assert PeerRing(rank=0, world_size=3, local_world_size=1, peers=5).copies == 2  # at most the other VMs


def test_the_plan_takes_the_newest_step_every_rank_can_get():
    lost = [
        Inventory(own=[40, 45], held={2: [40, 45]}, durable=40),
        Inventory(own=[], held={0: [40, 45]}),
        Inventory(own=[40, 45], held={1: [40, 45]}),
    ]
    chosen = plan(lost)
    assert (chosen.step, chosen.sources, chosen.transfers) == (45, [None, 2, None], [(2, 1)])
    two_lost = [Inventory(own=[40, 45], held={2: [40, 45]}, durable=40), Inventory(own=[]), Inventory(own=[])]
    assert plan(two_lost).step is None  # rank 1's state is nowhere: the durable tier
    behind = [Inventory(own=[35], durable=40), Inventory(own=[35])]
    assert plan(behind).step is None  # older than the durable step
    tie = [Inventory(own=[40], durable=40), Inventory(own=[40])]
    assert plan(tie).step == 40  # the same step: the local copy is the faster one


def test_an_emergency_save_is_sized_to_the_grace_left(monkeypatch):
    meter = grace.WriteMeter()
    assert meter.estimate(1 << 30) is None and grace.fits(None, 5.0)  # nothing observed: tried (atomic)
    meter.record(100 << 20, 2.0)
    meter.record(100 << 20, 4.0)  # the slowest rate counts
    assert meter.estimate(400 << 20) == pytest.approx(16.0)
    monkeypatch.setenv(grace.GRACE_VARIABLE, "30")
    left = grace.time_left(arrived_at=100.0, now=110.0)
    assert left == pytest.approx(30 - 10 - 3)
    assert grace.fits(16.0, left) and not grace.fits(18.0, left) and not grace.fits(None, -1.0)
    monkeypatch.setenv(grace.GRACE_VARIABLE, "soon")
    with pytest.raises(ConfigError, match="VERTEXRT_PREEMPTION_GRACE='soon'"):
        grace.grace_seconds()


def test_the_environment_switches_the_tier_on_and_bad_values_are_named(monkeypatch):
    monkeypatch.delenv(config.EVERY_VARIABLE, raising=False)
    assert FastTier.from_environment() is None
    monkeypatch.setenv(config.EVERY_VARIABLE, "5")
    assert FastTier.from_environment() == FastTier(every=EveryNSteps(5), peers=1)
    monkeypatch.setenv(config.PEERS_VARIABLE, "2")
    assert FastTier.from_environment() == FastTier(every=EveryNSteps(5), peers=2)
    monkeypatch.setenv(config.EVERY_VARIABLE, "0")
    with pytest.raises(ConfigError, match="VERTEXRT_FAST_CHECKPOINT_EVERY='0'"):
        FastTier.from_environment()
    with pytest.raises(ConfigError, match="peers"):
        FastTier(peers=-1)


def test_the_local_directory_is_the_variable_else_a_ram_disk_with_room_else_local_disk(monkeypatch, tmp_path):
    monkeypatch.setenv(config.LOCAL_DIR_VARIABLE, str(tmp_path))
    assert config.local_root(FastTier()) == (str(tmp_path), config.LOCAL_DIR_VARIABLE)
    monkeypatch.delenv(config.LOCAL_DIR_VARIABLE)
    root, why = config.local_root(FastTier())
    assert root in (config.RAM_DISK, tempfile.gettempdir()) and why
    monkeypatch.setattr(config, "MIN_RAM_DISK_FREE", 1 << 62)  # no RAM disk has that much room
    assert config.local_root(FastTier())[0] != config.RAM_DISK


def _write(steps: LocalSteps, step: int) -> None:
    from vertexrt.checkpoint import serialization

    tree, leaves = serialization.encode(make_state(step, sizes=(1000,)), allow_pickle=False)
    steps.write(step, tree, [n for n, _ in leaves], [e.data for _, e in leaves], world_size=1)


def test_local_steps_keep_two_and_list_only_complete_ones(tmp_path):
    steps = LocalSteps(str(tmp_path / "own"))
    for step in (5, 10, 15):
        _write(steps, step)
    assert steps.valid_steps(world_size=1) == [10, 15]  # the newest two
    assert steps.valid_steps(world_size=2) == []  # written by another world size
    os.makedirs(tmp_path / "own" / ".tmp.step_0000000020.host-1-0123456789abcdef")  # a write cut short
    part = next((tmp_path / "own" / "step_0000000015").glob("*.bin"))
    part.write_bytes(part.read_bytes()[:-1])  # truncated
    assert steps.valid_steps(world_size=1) == [10]
    loaded = steps.load(10, rank=0, world_size=1, allow_pickle=False)
    assert loaded.step == 10


def test_one_rank_resumes_from_a_fast_step_newer_than_the_durable_one(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv(config.LOCAL_DIR_VARIABLE, str(tmp_path / "local"))
    fast = FastTier(every=EveryNSteps(2), peers=1)  # one rank: no other VM, local copies only
    with CheckpointManager(str(tmp_path / "durable"), save_policy=EveryNSteps(10), fast=fast) as mgr:
        for step in range(15):
            mgr.save(step, make_state(step))
    with caplog.at_level(logging.INFO), CheckpointManager(str(tmp_path / "durable"), fast=fast) as mgr:
        assert mgr.all_steps() == [0, 10]
        assert_state_equal(mgr.restore(), make_state(14))
        assert mgr.restored_step == 14
    assert "fast checkpoint step 14 comes from its local copy" in caplog.text


def test_an_emergency_save_that_cannot_fit_keeps_the_fast_step_and_the_durable_one(tmp_path, monkeypatch):
    monkeypatch.setenv(config.LOCAL_DIR_VARIABLE, str(tmp_path / "local"))
    monkeypatch.setenv(grace.GRACE_VARIABLE, "1")  # no time left after the margin
    durable = str(tmp_path / "durable")
    fast = FastTier(every=EveryNSteps(100), peers=0)
    with CheckpointManager(durable, save_policy=EveryNSteps(5), fast=fast, save_on_preemption=True) as mgr:
        for step in range(8):
            mgr.save(step, make_state(step))
        os.kill(os.getpid(), signal.SIGTERM)
        assert mgr.preemption_requested()
        assert mgr.save(8, make_state(8), force=True) is False  # no durable save started
        assert mgr.all_steps() == [0, 5]
    assert not preemption_signal().requested  # the last subscription closed: the flag is cleared
    with CheckpointManager(durable, fast=fast) as mgr:
        assert_state_equal(mgr.restore(), make_state(8))  # the emergency's fast step


def test_an_emergency_save_that_fits_goes_to_the_durable_tier(tmp_path, monkeypatch):
    monkeypatch.setenv(config.LOCAL_DIR_VARIABLE, str(tmp_path / "local"))
    monkeypatch.setenv(grace.GRACE_VARIABLE, "600")
    durable = str(tmp_path / "durable")
    fast = FastTier(every=EveryNSteps(100), peers=0)
    with CheckpointManager(durable, save_policy=EveryNSteps(5), fast=fast, save_on_preemption=True) as mgr:
        for step in range(8):
            mgr.save(step, make_state(step))
        os.kill(os.getpid(), signal.SIGTERM)
        assert mgr.preemption_requested()
        assert mgr.save(8, make_state(8), force=True) is True
        mgr.wait()
        assert mgr.all_steps() == [0, 5, 8]
    assert not preemption_signal().requested


def test_several_ranks_without_torch_distributed_are_told_what_the_tier_needs(tmp_path, monkeypatch):
    from vertexrt.errors import CheckpointError

    monkeypatch.setenv(config.LOCAL_DIR_VARIABLE, str(tmp_path / "local"))
    fast = FastTier(every=EveryNSteps(2), peers=0)
    mgr = CheckpointManager(str(tmp_path / "durable"), rank=1, world_size=2, fast=fast)
    with mgr, pytest.raises(CheckpointError, match="torch.distributed"):
        mgr.restore()

"""The fast tier at work for a :class:`~vertexrt.checkpoint.CheckpointManager`: save, restore, emergency.

- **Save** (:meth:`FastCheckpoints.on_save`, at every ``save()`` call): when the tier's policy says so, the
  state is snapshotted on the caller's thread through the manager's staging path (``staging.Stager``: GPU
  leaves through the pinned arena, CPU leaves copied), then a background thread writes it to the local
  directory and exchanges copies with the peer ranks. One fast step is in flight at a time; a failure is
  raised (as ``CheckpointError``) at the next call.
- **Restore** (:meth:`FastCheckpoints.restore`): one all-gather of inventories; the ranks agree on the newest
  step every rank can get (:mod:`.plan`); ranks that lack it receive it from a holder, point to point; every
  rank reads and checksums its copy; a damaged copy is dropped and the agreement runs again. Each rank logs
  where its state came from. None means: restore from the durable tier.
- **Emergency** (the first ``save()`` after the ranks agreed on a preemption): the step is written to the
  fast tier synchronously with its peer copies, then the ranks agree whether a durable save of it fits in
  the grace period left at the observed durable write rate (:mod:`.grace`). When it does not, the manager
  skips the durable save: the previous durable step stays the newest, and nothing partial is ever visible.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from vertexrt.checkpoint import restoring
from vertexrt.checkpoint.decision import SaveDecision
from vertexrt.checkpoint.policies import LastSave
from vertexrt.checkpoint.tiers import config, grace
from vertexrt.checkpoint.tiers.config import FastTier
from vertexrt.checkpoint.tiers.local import LocalSteps
from vertexrt.checkpoint.tiers.peers import PeerRing, recv_step, send_step
from vertexrt.checkpoint.tiers.plan import Inventory, plan
from vertexrt.distributed import collectives
from vertexrt.errors import CheckpointCorruptError, CheckpointError, ClusterSpecError

log = logging.getLogger(__name__)

#: Rounds of agreement when copies turn out damaged on reading, before falling back to the durable tier.
RESTORE_ROUNDS = 3


class FastCheckpoints:
    """One rank's fast tier for the manager of the durable ``durable_directory``."""

    def __init__(
        self, tier: FastTier, *, durable_directory: str, rank: int, world_size: int, allow_pickle: bool
    ) -> None:
        root, why = config.local_root(tier)
        self.directory = config.run_directory(root, durable_directory)
        self.world_size = world_size
        self.allow_pickle = allow_pickle
        self.ring = PeerRing(rank, world_size, _local_world_size(world_size), tier.peers)
        mine = os.path.join(self.directory, f"rank_{rank}")
        self.own = LocalSteps(os.path.join(mine, "own"))
        self.held = {
            src: LocalSteps(os.path.join(mine, f"copy_of_rank_{src}")) for src in self.ring.sources()
        }
        self.meter = grace.WriteMeter()
        self._decision = SaveDecision(tier.every, world_size)
        self._started = time.time()
        self._last: tuple[int | None, float | None] = (None, None)
        self._stager: Any = None
        self._writer: ThreadPoolExecutor | None = None
        self._pending: Future[None] | None = None
        self._group: Any = None
        self._bytes = 0  # the last fast step's size
        self._emergency: tuple[int, bool] | None = None  # (step, durable save goes ahead)
        log.info(
            "fast checkpoint tier: local directory %s (%s); copies on %d other VM(s)",
            self.directory,
            why,
            self.ring.copies,
        )

    @property
    def rank(self) -> int:
        return self.ring.rank

    # -- saving --------------------------------------------------------------------------------------------

    def on_save(self, step: int, state: Any, *, preempted: bool) -> bool:
        """Take a fast step when due; returns whether the durable save may go ahead (False only when an
        emergency save would not fit in the grace period). Every rank calls it at every ``save()``."""
        self._raise_finished_error()
        if preempted:
            return self._emergency_save(step, state)
        last = LastSave(step=self._last[0], time=self._last[1], now=time.time(), start_time=self._started)
        if self._decision(step, last, rank=self.rank, dist=collectives.torch_dist):
            self._snapshot(step, state)
        return True

    def observe_durable_write(self, nbytes: int, seconds: float) -> None:
        """A durable save of ``nbytes`` took ``seconds`` (the emergency's rate estimate)."""
        self.meter.record(nbytes, seconds)

    def wait(self) -> None:
        """Block until the fast step in flight is written and copied; raise its error if it failed."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        try:
            pending.result()
        except CheckpointError:
            raise
        except Exception as exc:
            raise CheckpointError(
                f"the fast checkpoint step in {self.directory} failed: {exc}. Check free space there (set "
                f"{config.LOCAL_DIR_VARIABLE} to another local directory) and that every rank is alive"
            ) from exc

    def close(self) -> None:
        try:
            self.wait()
        finally:
            if self._writer is not None:
                self._writer.shutdown(wait=True)
                self._writer = None
            if self._stager is not None:
                self._stager.close()
                self._stager = None

    def _snapshot(self, step: int, state: Any) -> None:
        from vertexrt.checkpoint import dcp, serialization
        from vertexrt.checkpoint.staging import Stager

        self.wait()
        if dcp.holds_dtensors(state):
            raise CheckpointError(
                "the fast checkpoint tier does not hold sharded (DTensor) state yet; make the "
                "CheckpointManager without fast= (and unset VERTEXRT_FAST_CHECKPOINT_EVERY)"
            )
        tree, leaves = serialization.encode(state, allow_pickle=self.allow_pickle)
        if self._stager is None:
            self._stager = Stager()
        buffers = self._stager.stage([enc for _, enc in leaves], copy_host=True)
        self._last = (step, time.time())
        group = self._peer_group()  # made on the caller's thread: every rank reaches this call together
        if self._writer is None:
            self._writer = ThreadPoolExecutor(1, thread_name_prefix="vertexrt-fast-checkpoint")
        nodes = [node for node, _ in leaves]
        self._pending = self._writer.submit(self._write_and_copy, step, tree, nodes, buffers, group)

    def _write_and_copy(self, step: int, tree: Any, nodes: list[Any], buffers: Any, group: Any) -> None:
        self._bytes = self.own.write(step, tree, nodes, buffers, world_size=self.world_size)
        if group is None:
            return
        dist = collectives.torch_dist()
        sent: list[Any] = []
        for target in self.ring.targets():
            sent += send_step(self.own, step, target, group, dist)
        for source in self.ring.sources():
            recv_step(self.held[source], source, group, dist)
        collectives.wait_sent(sent)

    def _emergency_save(self, step: int, state: Any) -> bool:
        if self._emergency is not None and self._emergency[0] == step:
            return self._emergency[1]
        from vertexrt.preemption.signals import preemption_signal

        self.wait()
        if self._last[0] != step:
            self._snapshot(step, state)
        self.wait()  # the local copy and every peer copy are complete
        left = grace.time_left(preemption_signal().arrived_at, time.time())
        estimate = self.meter.estimate(self._bytes)
        too_slow = int(not grace.fits(estimate, left))
        dist = collectives.torch_dist() if self.world_size > 1 else None
        goes_ahead = collectives.all_max([too_slow], dist)[0] == 0
        self._emergency = (step, goes_ahead)
        seen = "not observed yet" if estimate is None else f"{estimate:.1f} s at the observed rate"
        if goes_ahead:
            log.warning(
                "preemption: fast step %d is on local disk and %d peer VM(s); its durable save (%s) fits in "
                "the %.1f s of grace left",
                step,
                self.ring.copies,
                seen,
                left,
            )
        else:
            log.warning(
                "preemption: fast step %d is on local disk and %d peer VM(s); a durable save (%s here, or on "
                "another rank) would not fit in the %.1f s of grace left, so none is started: the newest "
                "durable step stays the previous one",
                step,
                self.ring.copies,
                seen,
                left,
            )
        return goes_ahead

    # -- restoring -----------------------------------------------------------------------------------------

    def restore(self, durable_steps: Callable[[], list[int]]) -> restoring.Loaded | None:
        """This rank's state at the newest step every rank can get from the fast tier, or None (restore
        from the durable tier). Every rank calls it together; ``durable_steps`` is asked on rank 0 only."""
        self.wait()
        dist = collectives.torch_dist() if self.world_size > 1 else None
        if self.world_size > 1 and dist is None:
            raise CheckpointError(
                f"the fast checkpoint tier across {self.world_size} ranks agrees on a step through "
                "torch.distributed, which is not initialised (e.g. vertexrt.distributed.init_torch()); make "
                "the CheckpointManager without fast= (and unset VERTEXRT_FAST_CHECKPOINT_EVERY)"
            )
        group = self._peer_group()
        chosen = None
        for _ in range(RESTORE_ROUNDS):
            durable = max(durable_steps(), default=None) if self.rank == 0 else None
            mine = Inventory(
                own=self.own.valid_steps(world_size=self.world_size),
                held={
                    src: copies.valid_steps(world_size=self.world_size) for src, copies in self.held.items()
                },
                durable=durable,
            )
            chosen = plan(collectives.all_gather(mine, dist))
            if chosen.step is None:
                break
            loaded, failure = self._fetch(chosen.step, chosen.sources, group, dist)
            failures = collectives.all_gather(failure, dist)
            fatal = [f[3] for f in failures if f is not None and f[3]]
            if fatal:
                raise CheckpointError(f"restoring fast checkpoint step {chosen.step} failed: {fatal[0]}")
            if all(f is None for f in failures):
                assert loaded is not None
                self._forget_after(chosen.step)
                self._last = (chosen.step, None)
                return loaded
            for rank, step, holder, _ in (f for f in failures if f is not None):
                if rank == self.rank and holder is None:
                    self.own.remove(step)  # a damaged own copy: a peer's copy is tried next round
                if holder == self.rank:
                    self.held[rank].remove(step)
        durable_step = None if chosen is None else chosen.durable
        log.info(
            "rank %d: no fast checkpoint step that every rank can get is as new as the durable one (%s): its "
            "state comes from the durable tier",
            self.rank,
            "none" if durable_step is None else f"step {durable_step}",
        )
        self._forget_after(-1 if durable_step is None else durable_step)
        return None

    def _fetch(
        self, step: int, sources: list[int | None], group: Any, dist: Any
    ) -> tuple[restoring.Loaded | None, tuple[int, int, int | None, str] | None]:
        """Send the copies this rank holds for others, receive its own when it lacks it, read and check it;
        ``(loaded, None)`` or ``(None, (rank, step, holder, fatal message or ""))``."""
        sent: list[Any] = []
        for receiver, sender in enumerate(sources):
            if sender == self.rank:
                sent += send_step(self.held[receiver], step, receiver, group, dist)
        source = sources[self.rank]
        try:
            if source is not None:
                recv_step(self.own, source, group, dist)
            loaded = self.own.load(
                step, rank=self.rank, world_size=self.world_size, allow_pickle=self.allow_pickle
            )
        except CheckpointCorruptError as exc:
            log.warning("rank %d: fast checkpoint step %d is unusable: %s", self.rank, step, exc)
            return None, (self.rank, step, source, "")
        except CheckpointError as exc:
            return None, (self.rank, step, source, str(exc))
        finally:
            collectives.wait_sent(sent)
        if source is None:
            where = f"its local copy in {self.own.directory}"
        else:
            where = f"the copy kept by rank {source} (replica {self.ring.replica_of(source)})"
        log.info("rank %d: state of fast checkpoint step %d comes from %s", self.rank, step, where)
        return loaded, None

    def _forget_after(self, step: int) -> None:
        """Drop fast steps after ``step``: training goes on from ``step``, another timeline."""
        for steps in (self.own, *self.held.values()):
            steps.drop_newer(step)

    # -- internals -----------------------------------------------------------------------------------------

    def _peer_group(self) -> Any:
        if self._group is None and self.ring.copies > 0:
            dist = collectives.torch_dist()
            if dist is None:
                raise CheckpointError(
                    f"FastTier(peers={self.ring.peers}) across {self.world_size} ranks needs "
                    "torch.distributed initialised (e.g. vertexrt.distributed.init_torch()), or "
                    "FastTier(peers=0)"
                )
            self._group = collectives.new_gloo_group(dist)
        return self._group

    def _raise_finished_error(self) -> None:
        if self._pending is not None and self._pending.done():
            self.wait()


def _local_world_size(world_size: int) -> int:
    """Ranks per VM (1 when unknown: every rank then counts as its own VM)."""
    from vertexrt.distributed import world_info

    try:
        local = world_info().local_world_size
    except ClusterSpecError:
        return 1
    return local if local > 0 and world_size % local == 0 else 1

"""Agreeing across ranks that a preemption notice arrived, without waiting for the network or the GPU.

A blocking all-reduce after every step costs a network round trip per step (hundreds of microseconds with
gloo), and a CUDA flag read with ``.item()`` stalls the CPU until the GPU catches up. ``StopVote`` agrees
two ways, and the first to answer wins (both answer at the same call on every rank):

* **Votes at step boundaries.** Every ``k`` calls it starts an all-reduce in the background
  (``async_op=True``, CPU tensors: a gloo side group when the job's backend is NCCL) and reads it at the next
  vote, when it has long finished. ``k`` is agreed inside the vote so that votes are about ``interval``
  seconds apart, and never closer than a few times the vote's own measured latency (a slow all-reduce,
  e.g. a ring over 1,024 ranks, never stalls the loop). With slow steps the ranks agree one vote after the
  notice. But ``k`` is counted in calls from past step times: when steps slow down (fast prefetched
  batches, then data-bound steps) the next vote can be minutes away.
* **A clock-paced backstop**, for that case: a thread all-reduces the flag on a group of its own every
  ``BACKSTOP_INTERVAL`` seconds (or a few times its measured latency, if longer), whatever the steps do.
  When it finds a notice it holds each rank at its next call, agrees on the call after the furthest rank
  (one more small all-reduce) and every rank stops there. The stop is agreed a bounded time after the
  notice (about one interval plus two all-reduces) and lands at the next step boundary.

Without torch.distributed the local flag is the answer.

Measured (``benchmarks/scale.py``: gloo on CPU, loopback, 2 shared cores): one vote all-reduce (two int64)
takes a median 0.18 ms at 2 ranks and 2.8-3.3 ms at 4 and 8 (the processes outnumber the cores). gloo's
all-reduce is a ring, 2(N-1) hops: fitted to those points, 0.8 ms + 0.18 ms per hop, ~360 ms at 1,024 ranks
(issue 22 estimates 60-100 ms on a real network); a tree would be 2 log2 N hops (~4 ms), a by-node
reduction (8 local ranks, then a ring of 128 nodes) ~47 ms. At the ``LATENCY_FACTOR`` pace the votes are then
~1.5 s apart and each is read a whole interval after it started: the loop never waits for one, except the
first vote's read, once (at most the ring's latency minus ``VOTE_INTERVAL``, ~0.26 s), and the stop lands
within ~2 intervals of the notice (~3 s), well inside a Spot VM's 30 s grace. A faster reduction would
shorten that delay, not the loop's time, so the vote stays on the process group's own all-reduce.

Example:
    >>> vote = StopVote()
    >>> vote(False)
    False
"""

from __future__ import annotations

import atexit
import logging
import math
import threading
import time
from collections.abc import Callable
from typing import Any

from vertexrt.distributed.collectives import cpu_group, torch_dist

log = logging.getLogger(__name__)

#: Seconds between two votes once the step time is known: the stop lands at most ~2 intervals late.
VOTE_INTERVAL = 0.1
#: Seconds between two rounds of the clock-paced backstop (longer when its all-reduce is slower).
BACKSTOP_INTERVAL = 0.5
#: Votes and rounds are at least this many times their measured latency apart.
LATENCY_FACTOR = 4
#: Seconds ``drain()`` waits for the backstop's last round (the other ranks' rounds are paced too), and
#: at interpreter exit without a ``drain()`` (after a failure: a peer may be gone).
_DRAIN_WAIT, _EXIT_WAIT = 60.0, 5.0
_MAX_CALLS_BETWEEN_VOTES = 10_000


class StopVote:
    """``vote(local_flag) -> bool``: True on every rank from the same call on, once any rank's flag was True.

    All ranks must call it the same number of times, at the same points (it is a collective); ``drain()``
    once at the end, on every rank. ``reduce`` replaces torch.distributed with another blocking "any rank"
    reduction, asked at every call (e.g. a ``tf.distribute`` all-reduce for Keras under
    MultiWorkerMirroredStrategy). ``interval=0`` votes at every call, each read waiting for its all-reduce.
    """

    def __init__(self, reduce: Callable[[bool], bool] | None = None, interval: float = VOTE_INTERVAL) -> None:
        self._reduce = reduce
        self._interval = interval
        # the vote in flight: (work handle, its [flag, -calls between votes] tensor, start, completion time)
        self._pending: tuple[Any, Any, float, list[float]] | None = None
        self._agreed = False  # once True on every rank, no more collectives
        self._calls = 0
        self._next_vote = 1  # the call number of the next vote: the same on every rank
        self._every = 1  # calls between votes, as agreed by the last vote read
        self._last_vote: tuple[int, float] | None = None  # (call number, monotonic time) of the last vote
        self._latency = 0.0  # seconds the last vote's all-reduce took
        self._backstop: _Backstop | None = None

    def __call__(self, local: bool) -> bool:
        if self._agreed:
            return True
        if self._reduce is not None:
            self._agreed = bool(self._reduce(local))
            return self._agreed
        backstop = self._backstop
        if backstop is not None:
            stop_call = backstop.at_call(self._calls + 1, local)  # may hold this rank briefly (see _Backstop)
            if stop_call is not None and self._calls + 1 >= stop_call:
                self._calls += 1
                self._agreed = True
                return True
        self._calls += 1
        if self._calls < self._next_vote:  # between votes: nothing else to do on the per-step path
            return False
        dist = torch_dist()
        if dist is None or dist.get_world_size() == 1:
            self._agreed = local
            self._next_vote = self._calls + 1  # without a process group: the local flag at every call
            return local
        if self._backstop is None:  # the first vote: every rank is here, at the same call
            self._backstop = _Backstop(dist, first_call=self._calls, local=local)
        if self._read_pending():
            return True
        self._start(local, dist)
        self._next_vote = self._calls + self._every
        return False

    def drain(self) -> None:
        """Wait for the all-reduces in flight and end the backstop (before the process group is destroyed)."""
        try:
            self._read_pending()
        finally:
            backstop, self._backstop = self._backstop, None
            if backstop is not None:
                backstop.close()

    def _read_pending(self) -> bool:
        if self._pending is None:
            return False
        work, tensor, started, completed = self._pending
        self._pending = None
        work.wait()  # returns at once unless its latency is longer than the calls since it started
        # This vote's own latency, whether the read waited or not: a hiccup on one vote (a rank descheduled
        # for 50 ms) paces the next vote only, not the rest of the job.
        self._latency = (completed[0] if completed else time.monotonic()) - started
        stop, minus_every = (int(v) for v in tensor.tolist())
        self._every = max(1, -minus_every)
        self._agreed = bool(stop)
        return self._agreed

    def _start(self, local: bool, dist: Any) -> None:
        import torch

        now = time.monotonic()
        proposal = 1
        if self._last_vote is not None:
            calls, then = self._last_vote
            per_call = max((now - then) / max(self._calls - calls, 1), 1e-9)
            apart = max(self._interval, LATENCY_FACTOR * self._latency) if self._interval else 0.0
            proposal = min(_MAX_CALLS_BETWEEN_VOTES, max(1, math.ceil(apart / per_call)))
        self._last_vote = (self._calls, now)
        # MAX over ranks: any rank's notice stops everyone, and the smallest proposed cadence wins.
        tensor = torch.tensor([1 if local else 0, -proposal], dtype=torch.int64)
        work = dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=cpu_group(dist), async_op=True)
        completed: list[float] = []  # the completion time, set by the backend's thread
        work.get_future().add_done_callback(lambda _: completed.append(time.monotonic()))
        self._pending = (work, tensor, now, completed)


class _Backstop:
    """The clock-paced half of a :class:`StopVote`: a thread and a gloo group of its own.

    Round after round (every ``BACKSTOP_INTERVAL`` s, or ``LATENCY_FACTOR`` x its latency, agreed in the
    round) the thread all-reduces (MAX) ``[flag, closing, next pace]``. A flag anywhere: it holds the rank's
    next call (``at_call`` waits), all-reduces the number of calls each rank has made, and publishes the
    stop call, the one after the furthest rank's; the held calls then go on to it. A closing flag anywhere
    (``drain()`` on some rank) ends every rank's thread after the same round.
    """

    def __init__(self, dist: Any, *, first_call: int, local: bool) -> None:
        self._dist = dist
        self._group = dist.new_group(backend="gloo")  # the thread's own: never interleaved with the loop's
        self._changed = threading.Condition()
        self._calls = first_call  # calls this rank has made (updated in at_call)
        self._flag = local
        self._holding = False  # between the flag round and the stop call: calls past _held_at wait
        self._held_at = 0
        self._stop_call: int | None = None
        self._closing = threading.Event()
        self._thread = threading.Thread(target=self._run, name="vertexrt-stop-vote", daemon=True)
        self._thread.start()
        atexit.register(self._close_at_exit)  # before the process group's own teardown (registered earlier)

    def at_call(self, call: int, local: bool) -> int | None:
        """Record this rank's ``call``-th call; the agreed stop call once known (held until it is)."""
        with self._changed:
            self._calls = call
            self._flag = self._flag or local
            while self._holding and call > self._held_at:
                self._changed.wait()
            return self._stop_call

    def close(self, wait: float = _DRAIN_WAIT) -> None:
        """End the thread after a last round that every rank's thread joins (at most ``wait`` seconds)."""
        atexit.unregister(self._close_at_exit)
        self._closing.set()
        self._thread.join(wait)
        if self._thread.is_alive():
            log.warning("the stop vote's last round did not finish in %.0f s: another rank is gone?", wait)

    def _close_at_exit(self) -> None:
        self.close(_EXIT_WAIT)

    def _run(self) -> None:
        import torch

        dist, pace, latency = self._dist, BACKSTOP_INTERVAL, 0.0
        try:
            while True:
                closing = self._closing.wait(pace)
                proposal = max(BACKSTOP_INTERVAL, LATENCY_FACTOR * latency)
                state = torch.tensor([int(self._flag), int(closing), int(proposal * 1e6)], dtype=torch.int64)
                started = time.monotonic()
                dist.all_reduce(state, op=dist.ReduceOp.MAX, group=self._group)
                latency = time.monotonic() - started
                flag, closing_anywhere, pace_us = (int(v) for v in state.tolist())
                pace = pace_us / 1e6
                if flag:
                    self._agree_on_the_stop_call(torch)
                    return
                if closing_anywhere:
                    return
        except Exception as exc:  # the process group was destroyed, or a rank died: the loop's votes remain
            log.debug("the stop vote's backstop ended: %s", exc)
        finally:
            with self._changed:
                self._holding = False
                self._changed.notify_all()
            self._release_group()

    def _release_group(self) -> None:
        """Destroy the thread's group now: a gloo group left to the interpreter's teardown can abort it."""
        try:
            self._dist.destroy_process_group(self._group)
        except Exception as exc:  # the default group (and with it this one) is gone already
            log.debug("destroying the stop vote's group: %s", exc)

    def _agree_on_the_stop_call(self, torch: Any) -> None:
        with self._changed:
            self._holding, self._held_at = True, self._calls
        furthest = torch.tensor([self._held_at], dtype=torch.int64)
        self._dist.all_reduce(furthest, op=self._dist.ReduceOp.MAX, group=self._group)
        with self._changed:
            self._stop_call = int(furthest.item()) + 1
            self._holding = False
            self._changed.notify_all()


class PreemptionAgreement:
    """A SIGTERM notice agreed across ranks: one subscription to the process-wide owner plus a StopVote.

    What a framework callback needs at its step boundaries: call it at the same points on every rank;
    ``close()`` (idempotent) drains the vote and ends the subscription.

    Example:
        >>> agreement = PreemptionAgreement()
        >>> agreement()          # after each step, on every rank
        False
        >>> agreement.close()
    """

    def __init__(self) -> None:
        from vertexrt.preemption.signals import preemption_signal

        self._subscription: Any = preemption_signal().subscribe()
        self._vote: StopVote | None = StopVote()

    def __call__(self) -> bool:
        """True on every rank from the same call on, once SIGTERM arrived on any rank."""
        return self._vote is not None and self._vote(bool(self._subscription.requested))

    def close(self) -> None:
        vote, self._vote = self._vote, None
        if vote is not None:
            try:
                vote.drain()
            except Exception as exc:  # the process group may be gone already
                logging.getLogger(__name__).debug("draining the stop vote: %s", exc)
        subscription, self._subscription = self._subscription, None
        if subscription is not None:
            subscription.close()

"""The one SIGTERM owner: subscriptions closed in any order give the original handler back."""

from __future__ import annotations

import itertools
import os
import signal
from types import FrameType
from typing import Any

import pytest

from vertexrt.preemption.signals import PreemptionSignal, UnpolledWatch, preemption_signal


@pytest.fixture
def original_handler() -> Any:
    """A test-installed SIGTERM handler that records the signals it receives; removed afterwards."""
    received: list[int] = []

    def handler(signum: int, frame: FrameType | None) -> None:
        received.append(signum)

    before = signal.signal(signal.SIGTERM, handler)
    try:
        yield handler, received
    finally:
        signal.signal(signal.SIGTERM, before)


@pytest.mark.parametrize("order", list(itertools.permutations(range(3))))
def test_subscriptions_closed_in_any_order_restore_the_original_handler(
    original_handler: Any, order: tuple[int, ...]
) -> None:
    handler, received = original_handler
    subscriptions = [preemption_signal().subscribe() for _ in range(3)]
    for index in order:
        subscriptions[index].close()
    assert signal.getsignal(signal.SIGTERM) is handler
    os.kill(os.getpid(), signal.SIGTERM)  # a real SIGTERM reaches the original handler, nothing else
    assert received == [signal.SIGTERM]
    assert not preemption_signal().requested


def test_two_checkpoint_managers_closed_in_creation_order_leave_sigterm_working(
    original_handler: Any, tmp_path: Any
) -> None:
    from vertexrt.checkpoint import CheckpointManager

    handler, received = original_handler
    first = CheckpointManager(str(tmp_path / "a"), save_on_preemption=True)
    second = CheckpointManager(str(tmp_path / "b"), save_on_preemption=True)
    first.close()
    second.close()
    assert signal.getsignal(signal.SIGTERM) is handler
    os.kill(os.getpid(), signal.SIGTERM)
    assert received == [signal.SIGTERM]


def test_every_subscriber_sees_the_notice_and_the_original_handler_still_runs(original_handler: Any) -> None:
    _, received = original_handler
    with preemption_signal().subscribe() as a, preemption_signal().subscribe() as b:
        assert not a.requested
        os.kill(os.getpid(), signal.SIGTERM)
        assert a.requested and b.requested
        assert preemption_signal().arrived_at is not None
    assert received == [signal.SIGTERM]  # chained


def test_a_notice_counts_as_polled_only_once_a_subscriber_asked() -> None:
    owner = PreemptionSignal(signal.SIGUSR1)
    with owner.subscribe() as subscription:
        os.kill(os.getpid(), signal.SIGUSR1)
        assert owner.requested and owner.unpolled  # reading the owner is not a poll
        assert subscription.requested
        assert not owner.unpolled


def test_unpolled_watch_warns_once_about_a_notice_nobody_asked_about() -> None:
    import threading

    owner = PreemptionSignal(signal.SIGUSR1)
    warned: list[float] = []
    done = threading.Event()

    def warn(waited: float) -> None:
        warned.append(waited)
        done.set()

    with owner.subscribe():
        watch = UnpolledWatch(owner, after=0.0, warn=warn)
        try:
            os.kill(os.getpid(), signal.SIGUSR1)
            assert done.wait(30)
        finally:
            watch.stop()
    assert len(warned) == 1


def test_a_handler_taken_below_python_is_put_back_by_reassert_and_by_a_later_subscription(
    original_handler: Any,
) -> None:
    """As TensorFlow's multi-worker runtime does: a C handler replaces Python's, getsignal does not tell."""
    import ctypes

    libc = ctypes.CDLL(None)
    libc.signal.restype = ctypes.c_void_p
    libc.signal.argtypes = (ctypes.c_int, ctypes.c_void_p)
    for put_back in ("reassert", "subscribe"):
        owner = PreemptionSignal()
        first = owner.subscribe()
        assert owner.reassert() is False  # nothing replaced it
        ours = signal.getsignal(signal.SIGTERM)
        libc.signal(signal.SIGTERM, 1)  # SIG_IGN at the C level: the notice would be lost
        assert signal.getsignal(signal.SIGTERM) is ours  # Python still names ours
        signal.raise_signal(signal.SIGTERM)
        assert not owner.requested
        if put_back == "reassert":
            assert owner.reassert() is True
        else:
            owner.subscribe().close()
        signal.raise_signal(signal.SIGTERM)
        assert owner.requested
        first.close()
        assert signal.getsignal(signal.SIGTERM) is original_handler[0]

"""StopVote: real gloo processes stop at the same call, soon after one of them was notified."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest
import torch.multiprocessing as mp
from rank_exit import exits_hard

from vertexrt.preemption.vote import StopVote


@exits_hard
def _vote_worker(rank: int, port: int, out: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    vote = StopVote(interval=0)  # a vote at every call
    answers = [vote(rank == 1 and call == 5) for call in range(10)]  # rank 1 is notified at call 5
    vote.drain()
    dist.destroy_process_group()
    Path(out, f"rank{rank}").write_text(" ".join("1" if a else "0" for a in answers))


@pytest.mark.slow
def test_every_rank_stops_at_the_same_call(tmp_path: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(_vote_worker, args=(port, str(tmp_path)), nprocs=2, start_method="spawn")
    expected = "0 0 0 0 0 0 1 1 1 1"
    assert (tmp_path / "rank0").read_text() == expected
    assert (tmp_path / "rank1").read_text() == expected


#: The call at which rank 1 is notified in the paced test (the hiccups are long before it).
NOTICE = 70


@exits_hard
def _paced_worker(rank: int, port: int, out: str, hiccup: float) -> None:
    import time

    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    vote = StopVote(interval=0.02)  # steps of ~2 ms: a vote every ~10 calls
    answers = []
    for call in range(200):
        time.sleep(0.002)
        if call == (10 if rank == 0 else 40):  # one hiccup per rank (apart: they would cancel out)
            time.sleep(hiccup)
        answers.append(vote(rank == 1 and call >= NOTICE))
    vote.drain()
    dist.destroy_process_group()
    Path(out, f"rank{rank}").write_text(" ".join("1" if a else "0" for a in answers))


@pytest.mark.slow
@pytest.mark.parametrize("hiccup", [0.0, 0.05], ids=["steady", "a 50 ms hiccup on each rank"])
def test_votes_are_paced_by_the_step_time_and_every_rank_stops_at_the_same_call(
    tmp_path: Path, hiccup: float
) -> None:
    """A hiccup makes the other rank's vote slow once: it paces the next vote, not every later one."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(_paced_worker, args=(port, str(tmp_path), hiccup), nprocs=2, start_method="spawn")
    rank0, rank1 = (tmp_path / "rank0").read_text(), (tmp_path / "rank1").read_text()
    assert rank0 == rank1
    answers = rank0.split()
    first = answers.index("1")
    assert NOTICE < first <= NOTICE + 2 * 10 + 5, first  # at most two votes late (cadence ~10 calls)
    assert set(answers[first:]) == {"1"}


def test_without_a_process_group_the_local_flag_is_the_answer() -> None:
    vote = StopVote()
    assert vote(False) is False
    assert vote(True) is True
    assert vote(False) is True  # it stays stopped
    vote.drain()


#: Vertex's shortest grace between SIGTERM and SIGKILL in these tests' terms, and the slow step time.
GRACE, SLOW_STEP = 10.0, 0.3


@exits_hard
def _slowing_worker(rank: int, port: int, out: str) -> None:
    import time

    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    vote = StopVote()
    answers = [vote(False) for _ in range(300)]  # fast (prefetched) steps: votes thousands of calls apart
    for _ in range(int(GRACE / SLOW_STEP)):  # then data-bound steps; rank 1 is notified at the first
        time.sleep(SLOW_STEP)  # the step's duration, not a synchronisation
        answers.append(vote(rank == 1))
        if answers[-1]:
            break
    vote.drain()
    dist.destroy_process_group()
    Path(out, f"rank{rank}").write_text(" ".join("1" if a else "0" for a in answers))


@pytest.mark.slow
def test_steps_that_slow_down_after_fast_ones_still_agree_inside_the_grace(tmp_path: Path) -> None:
    """The votes' cadence was set in calls by the fast steps; the backstop agrees on the clock."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(_slowing_worker, args=(port, str(tmp_path)), nprocs=2, start_method="spawn")
    rank0, rank1 = (tmp_path / "rank0").read_text().split(), (tmp_path / "rank1").read_text().split()
    assert rank0 == rank1  # the same call on both ranks
    assert rank0[-1] == "1", f"no agreement within {len(rank0) - 301} slow steps (the grace)"
    assert rank0.index("1") > 300  # not before the notice

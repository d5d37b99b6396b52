"""Storage requests of sharded saves and restores as the number of ranks grows (real gloo ranks, the GCS
server behind one counting proxy per rank): deterministic counts, never timings."""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
from faultproxy import FaultProxy

from .ckpt_helpers import run_ranks

TEST_BUCKET = "vertexrt-test"
_LIST = re.compile(r"^GET /storage/v1/b/[^/]+/o(\?|\s)")
#: gcsfs's ``info`` races a one-object listing against its metadata GET and cancels the loser: whether that
#: listing reaches the server is timing, so it is left out of every count (the GET beside it is counted).
_INFO_PROBE = re.compile(r"[?&]maxResults=1(&|\s|$)")


@dataclass
class Requests:
    """One rank's storage requests in one job: how many, how many lists, bytes of GET responses."""

    total: int
    lists: int
    read_bytes: int


def _job(gcs_server, root: str, world: int, phase: str) -> tuple[list[Requests], list[dict]]:
    proxies = [FaultProxy(("127.0.0.1", gcs_server.port)).start() for _ in range(world)]
    try:
        results = run_ranks(
            "scale_worker.py",
            world,
            lambda rank, port: [str(rank), str(world), str(port), root, proxies[rank].endpoint, phase],
        )
        for rank, (code, _, err) in enumerate(results):
            assert code == 0, f"{phase} with {world} ranks, rank {rank}:\n{err[-4000:]}"
        counts = []
        for proxy in proxies:
            lines = [(line, size) for line, size in proxy.forwarded if not _INFO_PROBE.search(line)]
            counts.append(
                Requests(
                    total=len(lines),
                    lists=sum(1 for line, _ in lines if _LIST.match(line)),
                    read_bytes=sum(size for line, size in lines if line.startswith("GET ")),
                )
            )
        return counts, [json.loads(out.strip().splitlines()[-1]) for _, out, _ in results]
    finally:
        for proxy in proxies:
            proxy.stop()


@pytest.fixture(scope="module")
def measured(gcs_server) -> Iterator[dict[tuple[str, int], list[Requests]]]:
    """Requests per rank of a sharded save and of the restore of it, with 2 and with 4 ranks."""
    out = {}
    for world in (2, 4):
        root = f"gs://{TEST_BUCKET}/{uuid.uuid4().hex}"
        out["save", world], _ = _job(gcs_server, root, world, "save")
        out["restore", world], reports = _job(gcs_server, root, world, "restore")
        assert [r["restored"] for r in reports] == list(range(world)), reports
    yield out


@pytest.mark.slow
def test_the_chiefs_requests_for_a_commit_grow_by_at_most_two_from_2_to_4_ranks(measured):
    chief = {world: measured["save", world][0].total for world in (2, 4)}
    assert chief[4] - chief[2] <= 2, chief
    others = {world: {r.total for r in measured["save", world][1:]} for world in (2, 4)}
    assert others[2] == others[4] and len(others[4]) == 1, others  # each writes its own files, nothing more


@pytest.mark.slow
def test_restore_lists_and_non_chief_bytes_do_not_grow_with_the_ranks(measured):
    lists = {world: sum(r.lists for r in measured["restore", world]) for world in (2, 4)}
    assert lists[4] == lists[2], lists  # rank 0 lists, the others are told
    read = {world: measured["restore", world][1].read_bytes for world in (2, 4)}
    assert read[4] <= 1.25 * read[2], read
    assert all(r.lists == 0 for world in (2, 4) for r in measured["restore", world][1:]), measured


@pytest.mark.slow
def test_an_existing_step_is_refused_on_every_rank_by_rank_0s_answer(gcs_server):
    root = f"gs://{TEST_BUCKET}/{uuid.uuid4().hex}"
    _job(gcs_server, root, 2, "save")
    counts, reports = _job(gcs_server, root, 2, "exists")
    assert [r.get("error") for r in reports] == ["StepExistsError"] * 2, reports
    assert counts[1].total == 0, counts  # the other rank asked storage nothing


@pytest.mark.slow
def test_damaged_data_of_one_rank_falls_back_to_the_earlier_step_on_every_rank(gcs_server):
    root = f"gs://{TEST_BUCKET}/{uuid.uuid4().hex}"
    _, reports = _job(gcs_server, root, 2, "fallback")
    assert [r["restored"] for r in reports] == [[1, 0], [1, 1]], reports

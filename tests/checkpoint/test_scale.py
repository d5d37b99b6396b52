"""Storage requests of sharded saves and restores as the number of ranks grows (real gloo ranks, the GCS
server behind one counting proxy per rank): deterministic counts, never timings."""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

import pytest
from faultproxy import FaultProxy

from .ckpt_helpers import run_ranks

TEST_BUCKET = "vertexrt-test"
_LIST = re.compile(r"^GET /storage/v1/b/[^/]+/o(\?|\s)")
#: gcsfs's ``info`` (behind ``exists``) races a one-object listing against an object metadata GET and
#: cancels the loser: which of the two reaches the server is timing, so both are left out of every count.
_INFO_PROBE = re.compile(r"[?&]maxResults=1(&|\s|$)|^GET /storage/v1/b/[^/]+/o/[^?\s]+[\s?]")


@dataclass
class Requests:
    """One rank's storage requests in one phase: how many (``raw``: gcsfs's info halves included), how many
    lists, bytes of GET responses (of them, of manifests and of shard body files)."""

    raw: int
    total: int
    lists: int
    read_bytes: int
    manifest_bytes: int
    body_bytes: int


def _job(gcs_server, root: str, world: int, phases: list[str]) -> dict[str, tuple[list[Requests], list[Any]]]:
    """``phases`` run by ``world`` ranks, in order; per phase, each rank's requests and what it reported."""
    proxies = {p: [FaultProxy(("127.0.0.1", gcs_server.port)).start() for _ in range(world)] for p in phases}
    try:
        results = run_ranks(
            "scale_worker.py",
            world,
            lambda rank, port: [
                str(rank),
                str(world),
                str(port),
                root,
                *(f"{p}={proxies[p][rank].endpoint}" for p in phases),
            ],
        )
        for rank, (code, _, err) in enumerate(results):
            assert code == 0, f"{phases} with {world} ranks, rank {rank}:\n{err[-4000:]}"
        reports = [json.loads(out.strip().splitlines()[-1]) for _, out, _ in results]
        return {p: ([_counted(proxy) for proxy in proxies[p]], [r[p] for r in reports]) for p in phases}
    finally:
        for group in proxies.values():
            for proxy in group:
                proxy.stop()


def _counted(proxy: FaultProxy) -> Requests:
    lines = [(line, size) for line, size in proxy.forwarded if not _INFO_PROBE.search(line)]
    gets = [(line, size) for line, size in lines if line.startswith("GET ")]
    return Requests(
        raw=len(proxy.forwarded),
        total=len(lines),
        lists=sum(1 for line, _ in lines if _LIST.match(line)),
        read_bytes=sum(size for _, size in gets),
        manifest_bytes=sum(size for line, size in gets if "manifest.json" in line),
        body_bytes=sum(size for line, size in gets if ".body.json" in line),
    )


@pytest.fixture(scope="module")
def measured(gcs_server) -> dict[tuple[str, int], Any]:
    """Per rank, the requests of a sharded save, of the restore of it and of saving it again (2 ranks
    only), with 2 and with 4 ranks: one job per number of ranks."""
    out: dict[tuple[str, int], Any] = {}
    for world in (2, 4):
        root = f"gs://{TEST_BUCKET}/{uuid.uuid4().hex}"
        phases = ["save", "restore", "exists"] if world == 2 else ["save", "restore"]
        for phase, (counts, reports) in _job(gcs_server, root, world, phases).items():
            out[phase, world] = counts
            out[f"{phase} reports", world] = reports
    return out


@pytest.mark.slow
def test_the_chiefs_requests_for_a_commit_grow_by_at_most_two_from_2_to_4_ranks(measured):
    chief = {world: measured["save", world][0].total for world in (2, 4)}
    assert chief[4] - chief[2] <= 2, chief
    read = {world: measured["save", world][0].read_bytes for world in (2, 4)}
    assert read[4] <= 1.25 * read[2], read  # no shard record read per rank: the bodies come by gather
    others = {world: {r.total for r in measured["save", world][1:]} for world in (2, 4)}
    assert others[2] == others[4] and len(others[4]) == 1, others  # each writes its own files, nothing more


@pytest.mark.slow
def test_restore_lists_and_non_chief_bytes_do_not_grow_with_the_ranks(measured):
    for world in (2, 4):
        assert measured["restore reports", world] == list(range(world)), measured
    lists = {world: sum(r.lists for r in measured["restore", world]) for world in (2, 4)}
    assert lists[4] == lists[2], lists  # rank 0 lists, the others are told
    read = {world: measured["restore", world][1].read_bytes for world in (2, 4)}
    assert read[4] <= 1.25 * read[2], read
    assert all(r.lists == 0 for world in (2, 4) for r in measured["restore", world][1:]), measured


@pytest.mark.slow
def test_rank_0s_restore_reads_grow_only_by_the_step_headers_entries(measured):
    """Rank 0 reads the step header (per shard: prefix, file sizes, body reference) and its own body; an
    extra shard adds less to the header than a body (its tree) weighs. Each other rank reads one body."""
    chief = {world: measured["restore", world][0] for world in (2, 4)}
    per_shard = (chief[4].manifest_bytes - chief[2].manifest_bytes) / 2
    assert 0 < per_shard < chief[2].body_bytes == chief[4].body_bytes, chief
    others = {r.body_bytes for world in (2, 4) for r in measured["restore", world][1:]}
    assert len(others) == 1 and others.pop() > 0, measured
    assert all(r.manifest_bytes == 0 for world in (2, 4) for r in measured["restore", world][1:]), measured


@pytest.mark.slow
def test_an_existing_step_is_refused_on_every_rank_by_rank_0s_answer(measured):
    assert measured["exists reports", 2] == ["StepExistsError"] * 2, measured
    assert measured["exists", 2][1].raw == 0, measured  # the other rank asked storage nothing


@pytest.mark.slow
def test_damaged_data_of_one_rank_falls_back_to_the_earlier_step_on_every_rank(gcs_server):
    root = f"gs://{TEST_BUCKET}/{uuid.uuid4().hex}"
    [(_, reports)] = _job(gcs_server, root, 2, ["fallback"]).values()
    assert reports == [[1, 0], [1, 1]], reports


@pytest.mark.slow
def test_a_damaged_or_missing_body_file_falls_back_on_every_rank(gcs_server):
    root = f"gs://{TEST_BUCKET}/{uuid.uuid4().hex}"
    [(_, reports)] = _job(gcs_server, root, 2, ["bodies"]).values()
    assert reports == [[1, 0], [1, 1]], reports


@pytest.mark.slow
def test_a_format_version_1_sharded_step_still_restores(gcs_server):
    root = f"gs://{TEST_BUCKET}/{uuid.uuid4().hex}"
    [(_, reports)] = _job(gcs_server, root, 2, ["v1"]).values()
    assert reports == [[0, 1], [1, 1]], reports

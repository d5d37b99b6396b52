"""BigQuery through the real google-cloud-bigquery client against a loopback REST fake (real HTTP/JSON)."""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterator

import pytest

from vertexrt.data import BigQuery, open_dataset
from vertexrt.errors import DataError

from .bigquery_fake import FakeBigQuery

ROWS = [
    {"id": i, "name": f"n{i}", "score": i / 8, "ok": i % 2 == 0, "tags": [f"t{i}"] * (i % 3)}
    for i in range(2345)
]
SCHEMA = [
    ("id", "INTEGER"),
    ("name", "STRING"),
    ("score", "FLOAT"),
    ("ok", "BOOLEAN"),
    ("tags", "STRING", "REPEATED"),
]


@pytest.fixture
def bigquery(monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeBigQuery]:
    fake = FakeBigQuery().start()
    fake.add_table("proj-1.ds.training", SCHEMA, ROWS)
    monkeypatch.setenv("BIGQUERY_EMULATOR_HOST", fake.endpoint)
    monkeypatch.setenv("GOOGLE_CLOUD_PROJECT", "proj-1")
    monkeypatch.delenv("CLOUD_ML_PROJECT_ID", raising=False)
    try:
        yield fake
    finally:
        fake.stop()


def test_reads_a_table_with_paging(bigquery: FakeBigQuery) -> None:
    ds = open_dataset(
        "bq://proj-1.ds.training", format=BigQuery(page_size=500), shuffle=False, rank=0, world_size=1
    )
    assert list(ds) == ROWS
    pages = [p for m, p in bigquery.requests if p.endswith("/tables/training/data")]
    assert len(pages) == 5  # 2345 rows in pages of 500, over real HTTP


def test_sharded_exactly_once_and_resumable(bigquery: FakeBigQuery) -> None:
    seen: Counter[int] = Counter()
    for rank in range(3):
        ds = open_dataset(
            "proj-1.ds.training",
            format="bigquery",
            rank=rank,
            world_size=3,
            shuffle_buffer=100,
            equalize=None,
        )
        seen.update(r["id"] for r in ds)
    assert seen == Counter(range(len(ROWS)))

    opts = {"rank": 1, "world_size": 2, "seed": 3, "shuffle_buffer": 64, "format": BigQuery(page_size=300)}
    full = [r["id"] for r in open_dataset("bq://proj-1.ds.training", **opts)]  # type: ignore[arg-type]
    ds = open_dataset("bq://proj-1.ds.training", **opts)  # type: ignore[arg-type]
    it = iter(ds)
    head = [next(it)["id"] for _ in range(500)]
    state = json.loads(json.dumps(ds.state_dict()))
    del it
    again = open_dataset("bq://proj-1.ds.training", **opts)  # type: ignore[arg-type]
    again.load_state_dict(state)
    assert head + [r["id"] for r in again] == full


def test_columns_and_environment_uri(bigquery: FakeBigQuery, vertex_env, monkeypatch) -> None:
    vertex_env(extra={"AIP_DATA_FORMAT": "bigquery", "AIP_TRAINING_DATA_URI": "bq://proj-1.ds.training"})
    monkeypatch.setenv("BIGQUERY_EMULATOR_HOST", bigquery.endpoint)  # the Vertex builder clears it
    ds = open_dataset(
        format=BigQuery(columns=["id", "ok"], project="proj-1"), shuffle=False, rank=0, world_size=1
    )
    assert next(iter(ds)) == {"id": 0, "ok": True}


def test_missing_table_is_a_data_error(bigquery: FakeBigQuery) -> None:
    ds = open_dataset("bq://proj-1.ds.nope", rank=0, world_size=1)
    with pytest.raises(DataError, match=r"bq://proj-1\.ds\.nope: cannot read the table \(NotFound"):
        list(ds)


def test_the_fake_answers_queries_through_the_real_client(bigquery: FakeBigQuery) -> None:
    from vertexrt.clients import bigquery_client

    client = bigquery_client()
    rows = list(client.query_and_wait("SELECT id, name FROM `proj-1.ds.training` LIMIT 3", page_size=2))
    assert [dict(r.items()) for r in rows] == [{"id": i, "name": f"n{i}"} for i in range(3)]
    job = client.query("SELECT * FROM `proj-1.ds.training` LIMIT 1201")
    assert [r["id"] for r in job.result(page_size=600)] == list(range(1201))


@pytest.mark.timeout(90)  # without BigQuery(timeout=...) the client would retry for 10 minutes
def test_unreachable_endpoint_fails_within_the_timeout(monkeypatch) -> None:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # closed again: nothing listens there
    monkeypatch.setenv("BIGQUERY_EMULATOR_HOST", f"http://127.0.0.1:{port}")
    monkeypatch.setenv("GOOGLE_CLOUD_PROJECT", "proj-1")
    monkeypatch.delenv("CLOUD_ML_PROJECT_ID", raising=False)
    ds = open_dataset("bq://proj-1.ds.training", format=BigQuery(timeout=2), rank=0, world_size=1)
    with pytest.raises(DataError, match=r"bq://proj-1\.ds\.training: cannot read the table"):
        list(ds)

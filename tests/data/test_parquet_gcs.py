"""Parquet on Cloud Storage is read by range requests under the storage deadline and retry policy: the rows
and resume of the local file, a stalled request ended as the typed error naming the file (never a hang), a
dropped connection retried, and only the footer and the reader's own row groups fetched."""

from __future__ import annotations

import io
import math
import random
import uuid
from typing import Any

import pytest

from vertexrt.data import Parquet, _ranged, open_dataset
from vertexrt.data.formats.base import Errors, FileSource
from vertexrt.errors import DataError

from .conftest import assert_resumes_exactly, read_all, write_bytes

RANGE = 20_011  # small, odd ranges: a row group's column chunks span several
GROUP_ROWS = 1000
FOOTER_READ = 64 << 10  # what pyarrow reads first, from the end of the file
HEADER_ALLOWANCE = 2048  # HTTP response headers per request, on top of the body


@pytest.fixture
def small_ranges(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_ranged, "RANGE_SIZE", RANGE)


def parquet_bytes(groups: int = 8) -> bytes:
    """``groups`` row groups of ``GROUP_ROWS`` rows ``{"id", "blob", "x"}`` (incompressible blobs)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = random.Random(3)
    rows = groups * GROUP_ROWS
    table = pa.table(
        {
            "id": list(range(rows)),
            "blob": [rng.randbytes(rng.randrange(0, 60)) for _ in range(rows)],
            "x": [rng.random() for _ in range(rows)],
        }
    )
    sink = io.BytesIO()
    pq.write_table(table, sink, row_group_size=GROUP_ROWS)
    return sink.getvalue()


def chunk_spans(data: bytes) -> list[tuple[int, int]]:
    """``(first byte, length)`` of each row group's column chunks (contiguous: pyarrow reads them at once)."""
    import pyarrow.parquet as pq

    meta = pq.ParquetFile(io.BytesIO(data)).metadata
    spans = []
    for index in range(meta.num_row_groups):
        group = meta.row_group(index)
        columns = [group.column(c) for c in range(group.num_columns)]
        first = min(c.dictionary_page_offset or c.data_page_offset for c in columns)
        spans.append((first, sum(c.total_compressed_size for c in columns)))
    return spans


def on_gcs(gcs_server: Any, data: bytes) -> str:
    return write_bytes(f"gs://{gcs_server.bucket}/{uuid.uuid4().hex}/t.parquet", data)


@pytest.mark.parametrize("world_size", [1, 3])
def test_rows_are_those_of_the_local_file(
    small_ranges: None, gcs_server: Any, tmp_path: Any, world_size: int
) -> None:
    data = parquet_bytes()
    local = tmp_path / "t.parquet"
    local.write_bytes(data)
    uri = on_gcs(gcs_server, data)
    for rank in range(world_size):  # with 3 readers the file is read in pieces of whole row groups
        options: dict[str, Any] = {"rank": rank, "world_size": world_size, "equalize": None}
        options["format"] = Parquet(batch_rows=300)
        expected = read_all(str(local), **options)
        assert expected and read_all(uri, **options) == expected


def test_resume_mid_file_is_exact(small_ranges: None, gcs_server: Any) -> None:
    uri = on_gcs(gcs_server, parquet_bytes())
    assert_resumes_exactly(uri, (1, GROUP_ROWS * 3 + 17, len(read_all(uri)) - 1))


@pytest.mark.timeout(30)  # the old reader (gcsfs's file object) waits on a stalled request for good
@pytest.mark.parametrize("stalled", ["footer", "row group 1"])
def test_a_stalled_request_ends_as_the_typed_error_naming_the_file(
    small_ranges: None, gcs_server: Any, fault_proxy: Any, monkeypatch: pytest.MonkeyPatch, stalled: str
) -> None:
    data = parquet_bytes()
    uri = on_gcs(gcs_server, data)
    full = read_all(uri)
    footer = len(data) - FOOTER_READ
    group0 = chunk_spans(data)[0][0]
    monkeypatch.setenv("VERTEXRT_STORAGE_TIMEOUT", "1")
    # the footer stalled, or every request after the footer and row group 0's first range
    spared = "(?!)" if stalled == "footer" else f"{footer}-|{group0}-"
    fault_proxy.set("stall", match=rf"(?i)range: bytes=(?!{spared})")
    got: list[Any] = []
    with pytest.raises(DataError, match=r"no usable answer within 1 s while reading " + uri):
        for row in open_dataset(uri, shuffle=False, rank=0, world_size=1):
            got.append(row)
    assert got == full[: len(got)]
    assert fault_proxy.handled["stall"] >= 1


@pytest.mark.timeout(60)
def test_a_dropped_connection_is_retried(
    small_ranges: None, gcs_server: Any, fault_proxy: Any, tmp_path: Any
) -> None:
    data = parquet_bytes()
    local = tmp_path / "t.parquet"
    local.write_bytes(data)
    uri = on_gcs(gcs_server, data)
    fault_proxy.set("reset", count=1, match=rf"(?i)range: bytes={chunk_spans(data)[2][0]}-")
    assert read_all(uri) == read_all(str(local))
    assert fault_proxy.handled["reset"] == 1


def test_a_reader_fetches_only_the_footer_and_its_row_groups(
    small_ranges: None, gcs_server: Any, fault_proxy: Any
) -> None:
    data = parquet_bytes()
    uri = on_gcs(gcs_server, data)
    spans = chunk_spans(data)
    owned = spans[2:4]  # rows 2000-3999: row groups 2 and 3 of 8
    expected_requests = math.ceil(FOOTER_READ / RANGE) + sum(math.ceil(n / RANGE) for _, n in owned)
    expected_bytes = FOOTER_READ + sum(n for _, n in owned)
    source = FileSource(uri, len(data))
    for _ in range(2):  # the same requests every time
        fault_proxy.forwarded.clear()
        before = fault_proxy.handled["pass"]
        batches = list(Parquet().read(source, 2 * GROUP_ROWS, 4 * GROUP_ROWS, Errors()))
        assert [row["id"] for _, rows in batches for row in rows] == list(range(2000, 4000))
        requests = fault_proxy.handled["pass"] - before
        assert requests == expected_requests  # no metadata request, no whole-file read
        received = sum(size for _, size in fault_proxy.forwarded)
        assert expected_bytes <= received <= expected_bytes + requests * HEADER_ALLOWANCE
    assert expected_bytes < len(data) / 2

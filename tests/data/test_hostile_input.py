"""Hostile or unlucky input: bounded time and memory, typed errors naming file and place, and every good
record before the damage delivered (then raise, or skip and count)."""

from __future__ import annotations

import gzip
import re
import struct
import zlib

import pytest

from vertexrt import paths
from vertexrt.data import CSV, JSONL, Parquet, TFRecord, TFRecordWriter, open_dataset
from vertexrt.data.formats.tfrecord import masked_crc32c
from vertexrt.errors import DataError

from .conftest import write_bytes

LIMIT = 64 << 10  # a small max_record_bytes keeps these tests fast and light


def read(uri: str, fmt: object = None, **kw: object) -> list[object]:
    return list(open_dataset(uri, fmt, shuffle=False, rank=0, world_size=1, **kw))  # type: ignore[arg-type]


def skipping(uri: str, fmt: object = None) -> tuple[list[object], int]:
    ds = open_dataset(uri, fmt, shuffle=False, rank=0, world_size=1, on_error="skip")  # type: ignore[arg-type]
    return list(ds), ds.skipped


# -- CSV: a stray quote ----------------------------------------------------------------------------------
def stray_quote_csv(rows: int) -> bytes:
    good = b"".join(b"%d,row %d,x\n" % (i, i) for i in range(rows))
    return b"id,text,z\n" + b'0,1,2\n1,2,3\n2,3,4\n3,4,5\n4,"unterminated,6\n' + good


def test_csv_stray_quote_in_a_large_file_is_a_data_error_naming_file_and_line(tmp_path) -> None:
    uri = write_bytes(str(tmp_path / "s.csv"), stray_quote_csv(60_000))  # ~1 MiB after the quote
    fmt = CSV(max_record_bytes=LIMIT)
    with pytest.raises(DataError, match=r"s\.csv:6 \(byte 34\): .*longer than 65536 bytes.*quote"):
        read(uri, fmt)
    records, skipped = skipping(uri, fmt)
    assert records[:4] == [{"id": str(i), "text": str(i + 1), "z": str(i + 2)} for i in range(4)]
    assert len(records) == 4 + 60_000 and skipped == 1  # reading goes on after the overlong line
    assert records[-1] == {"id": "59999", "text": "row 59999", "z": "x"}


def test_csv_stray_quote_within_the_limit_reads_in_linear_time(tmp_path) -> None:
    uri = write_bytes(str(tmp_path / "q.csv"), stray_quote_csv(200_000))  # ~3.6 MiB quoted to the end
    with pytest.raises(DataError, match=r"q\.csv:6 \(byte 34\): CSV row has 2 columns, the header has 3"):
        read(uri)
    records, skipped = skipping(uri)
    assert len(records) == 4 and skipped == 1


def test_csv_field_over_128_kib_is_read(tmp_path) -> None:
    import csv

    big = "y" * (300 << 10)
    uri = write_bytes(str(tmp_path / "b.csv"), f'a,b\n1,"{big}"\n2,3\n'.encode())
    assert read(uri) == [{"a": "1", "b": big}, {"a": "2", "b": "3"}]
    previous = csv.field_size_limit(1000)  # lowered by other code in the process
    try:
        assert read(uri) == [{"a": "1", "b": big}, {"a": "2", "b": "3"}]
    finally:
        csv.field_size_limit(previous)


def test_csv_undecodable_byte_delivers_the_rows_before_it(tmp_path) -> None:
    uri = write_bytes(str(tmp_path / "l.csv"), b"a,b\n1,2\n3,4\n5,6\n7,8\ncaf\xe9,9\n10,11\n")
    ds = open_dataset(uri, shuffle=False, rank=0, world_size=1)
    got = []
    with pytest.raises(DataError, match=r"l\.csv:6 \(byte 20\): .*not UTF-8"):
        for record in ds:
            got.append(record)
    assert got == [{"a": "1", "b": "2"}, {"a": "3", "b": "4"}, {"a": "5", "b": "6"}, {"a": "7", "b": "8"}]
    records, skipped = skipping(uri)
    assert records == [*got, {"a": "10", "b": "11"}] and skipped == 1


# -- bounded memory on hostile compressed input ------------------------------------------------------------
def test_gzip_line_without_newline_is_bounded(tmp_path) -> None:
    blob = gzip.compress(b'{"a": 1}\n{"a": 2}\n') + gzip.compress(b"x" * (8 << 20))  # 2nd member: one line
    uri = write_bytes(str(tmp_path / "g.jsonl.gz"), blob)
    fmt = JSONL(max_record_bytes=LIMIT)
    with pytest.raises(DataError, match=r"g\.jsonl\.gz:3 \(byte 18\): a line is longer than 65536 bytes"):
        read(uri, fmt)
    assert skipping(uri, fmt) == ([{"a": 1}, {"a": 2}], 1)


def tfrecord_with_length(root: str, name: str, length: int, gz: bool = False) -> str:
    header = struct.pack("<Q", length)
    good = b"".join(
        struct.pack("<Q", 3)
        + struct.pack("<I", masked_crc32c(struct.pack("<Q", 3)))
        + b"abc"
        + struct.pack("<I", masked_crc32c(b"abc"))
        for _ in range(2)
    )
    data = good + header + struct.pack("<I", masked_crc32c(header)) + b"\0" * 64
    return write_bytes(paths.join(root, name), gzip.compress(data) if gz else data)


@pytest.mark.parametrize("gz", [False, True])
@pytest.mark.parametrize("length", [1 << 40, 1 << 63])
def test_tfrecord_huge_length_is_refused_before_allocating(tmp_path, gz: bool, length: int) -> None:
    uri = tfrecord_with_length(str(tmp_path), "h.tfrecord" + (".gz" if gz else ""), length, gz)
    fmt = TFRecord(max_record_bytes=LIMIT)
    with pytest.raises(DataError, match=rf"h\.tfrecord.*: record at byte 38 claims {length} bytes"):
        read(uri, fmt)
    assert skipping(uri, fmt) == ([b"abc", b"abc"], 1)
    with pytest.raises(DataError, match=r"record at byte 38 claims .* max_record_bytes=268435456"):
        read(uri)  # the default limit is generous but finite


# -- good records before the damage ----------------------------------------------------------------------
@pytest.mark.parametrize("name", ["t.jsonl.gz", "t.csv.gz"])
def test_truncated_gzip_delivers_every_readable_record(storage_root: str, name: str) -> None:
    csv = name.endswith(".csv.gz")
    lines = b"".join((b"%d,%d\n" if csv else b'{"i": %d, "j": %d}\n') % (i, i) for i in range(20_000))
    blob = gzip.compress((b"i,j\n" if csv else b"") + lines)
    uri = write_bytes(paths.join(storage_root, name), blob[: len(blob) // 2])
    readable = zlib.decompressobj(31).decompress(blob[: len(blob) // 2]).count(b"\n") - csv
    got: list[object] = []
    with pytest.raises(DataError, match=re.escape(name) + ": compressed stream ends early"):
        for record in open_dataset(uri, shuffle=False, rank=0, world_size=1):
            got.append(record)
    assert len(got) == readable > 1000
    records, skipped = skipping(uri)
    assert records == got and skipped == 1
    shuffled: list[object] = []
    with pytest.raises(DataError, match="compressed stream ends early"):
        for record in open_dataset(uri, rank=0, world_size=1, shuffle_buffer=100_000):
            shuffled.append(record)
    assert sorted(map(str, shuffled)) == sorted(map(str, got))  # the partial shuffle block too


def test_truncated_gzip_tfrecord_delivers_every_readable_record(tmp_path) -> None:
    uri = str(tmp_path / "t.tfrecord.gz")
    with TFRecordWriter(uri) as writer:
        for i in range(20_000):
            writer.write(b"%08d" % i)
    blob = open(uri, "rb").read()  # noqa: SIM115
    write_bytes(uri, blob[: len(blob) // 2])
    records, skipped = skipping(uri)
    assert records == [b"%08d" % i for i in range(len(records))] and len(records) > 1000 and skipped == 1


# -- Parquet -----------------------------------------------------------------------------------------------
def parquet_file(uri: str, groups: int = 3, rows: int = 1000) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.table({"x": list(range(groups * rows)), "s": [f"value {i}" * 3 for i in range(groups * rows)]})
    with paths.open(uri, "wb") as f:
        pq.write_table(table, f, row_group_size=rows, compression="snappy")


def test_parquet_corrupt_page_names_file_and_row_group(storage_root: str) -> None:
    import pyarrow.parquet as pq

    uri = paths.join(storage_root, "c.parquet")
    parquet_file(uri)
    with paths.open(uri, "rb") as f:
        data = bytearray(f.read())
    column = pq.ParquetFile(paths.open(uri, "rb")).metadata.row_group(1).column(1)
    start = column.data_page_offset + 40
    data[start : start + 200] = b"\xff" * 200
    write_bytes(uri, bytes(data))
    got: list[object] = []
    with pytest.raises(DataError, match=r"c\.parquet: row group 1 \(rows 1000-1999\)"):
        for record in open_dataset(uri, shuffle=False, rank=0, world_size=1):
            got.append(record)
    assert [r["x"] for r in got] == list(range(1000))  # type: ignore[index]
    records, skipped = skipping(uri)
    assert [r["x"] for r in records] == [*range(1000), *range(2000, 3000)] and skipped == 1  # type: ignore[index]


def test_zero_byte_parquet_among_good_files_is_an_empty_shard(storage_root: str) -> None:
    parquet_file(paths.join(storage_root, "a.parquet"), groups=1, rows=10)
    write_bytes(paths.join(storage_root, "b.parquet"), b"")
    assert len(read(paths.join(storage_root, "*.parquet"))) == 10
    write_bytes(paths.join(storage_root, "c.parquet"), b"not parquet at all")
    with pytest.raises(DataError, match=r"c\.parquet: not a readable Parquet file"):
        read(paths.join(storage_root, "*.parquet"))
    records, skipped = skipping(paths.join(storage_root, "*.parquet"), Parquet())
    assert len(records) == 10 and skipped == 1


# -- storage that never answers: every data read has a deadline ------------------------------------------


@pytest.mark.timeout(60)
def test_a_stalled_cloud_storage_read_ends_with_a_typed_error_naming_the_file(
    gcs_server, fault_proxy, monkeypatch: pytest.MonkeyPatch
) -> None:
    import uuid

    uri = f"gs://{gcs_server.bucket}/{uuid.uuid4().hex}/train.jsonl"
    write_bytes(uri, b"".join(b'{"id": %d}\n' % i for i in range(50)))
    monkeypatch.setenv("VERTEXRT_STORAGE_TIMEOUT", "1")
    ds = open_dataset(uri, shuffle=False, rank=0, world_size=1)
    fault_proxy.set("stall")  # every request from now on is accepted and never answered
    with pytest.raises(
        DataError, match=r"no usable answer within 1 s while (opening|reading) " + re.escape(uri)
    ):
        list(ds)
    with pytest.raises(DataError, match=r"no usable answer within 1 s while listing"):
        open_dataset(uri)
    assert fault_proxy.handled["stall"] >= 2
    fault_proxy.set("pass")
    assert len(list(open_dataset(uri, shuffle=False, rank=0, world_size=1))) == 50


@pytest.mark.timeout(30)
def test_a_fifo_is_not_a_data_file(tmp_path) -> None:
    import os

    (tmp_path / "a.jsonl").write_bytes(b'{"id": 1}\n')
    os.mkfifo(tmp_path / "b.jsonl")  # no writer: a read would block forever
    assert [r["id"] for r in read(f"{tmp_path}/*.jsonl")] == [1]
    assert [r["id"] for r in read(str(tmp_path))] == [1]
    with pytest.raises(DataError, match=r"b.jsonl' is not a regular file"):
        open_dataset(str(tmp_path / "b.jsonl"))


@pytest.mark.timeout(60)
def test_a_stalled_object_of_a_files_dataset_is_skipped_or_named(
    gcs_server, fault_proxy, monkeypatch: pytest.MonkeyPatch
) -> None:
    import uuid

    root = f"gs://{gcs_server.bucket}/{uuid.uuid4().hex}"
    for name in ("cat/a.jpg", "cat/b.jpg", "dog/c.jpg"):
        write_bytes(f"{root}/{name}", name.encode())
    monkeypatch.setenv("VERTEXRT_STORAGE_TIMEOUT", "1")
    fault_proxy.set("stall", match="cat%2Fb.jpg")  # that object's requests only
    ds = open_dataset(f"{root}/*/*.jpg", shuffle=False, rank=0, world_size=1, on_error="skip")
    assert [r["bytes"] for r in ds] == [b"cat/a.jpg", b"dog/c.jpg"] and ds.skipped == 1
    with pytest.raises(DataError, match=r"no usable answer within 1 s while .*cat/b.jpg"):
        read(f"{root}/*/*.jpg")

"""Few large files, many readers: each file is cut into byte ranges, so a reader reads about its share."""

from __future__ import annotations

import json
import os
import uuid
from collections import Counter
from typing import Any

import pytest

from vertexrt import paths
from vertexrt.data import CSV, merge_states, open_dataset
from vertexrt.data._io import TAIL_READ
from vertexrt.errors import DataError

ROWS = 60_000


class Counted:
    """A file object that adds the bytes read through it to a shared tally."""

    def __init__(self, f: Any, tally: Counter[str]):
        self._f = f
        self._tally = tally

    def read(self, size: int = -1) -> bytes:
        data: bytes = self._f.read(size)
        self._tally["bytes"] += len(data)
        return data

    def __getattr__(self, name: str) -> Any:
        return getattr(self._f, name)


@pytest.fixture
def tally(monkeypatch: pytest.MonkeyPatch) -> Counter[str]:
    """Bytes read through ``vertexrt.paths.open`` (the one opener every format uses)."""
    counts: Counter[str] = Counter()
    opener = paths.open
    monkeypatch.setattr(paths, "open", lambda *a, **k: Counted(opener(*a, **k), counts))
    return counts


@pytest.fixture
def big_csv(tmp_path) -> str:
    uri = str(tmp_path / "big.csv")
    with open(uri, "w") as f:
        f.write("id,text\n" + "".join(f'{i},"row {i}, {"x" * (i % 300)}"\n' for i in range(ROWS)))
    return uri


def ids(ds: Any) -> list[int]:
    return [int(r["id"]) for r in ds]


@pytest.mark.parametrize("readers", [3, 8])
def test_one_file_many_readers_reads_about_a_share_each(
    big_csv: str, tally, readers: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("vertexrt.data.formats.base.MIN_PIECE_BYTES", 256 << 10)  # 4 pieces per reader
    size = os.path.getsize(big_csv)
    seen: Counter[int] = Counter()
    per_reader = []
    for rank in range(readers):
        tally.clear()
        ds = open_dataset(big_csv, seed=3, shuffle_buffer=1, rank=rank, world_size=readers, equalize=None)
        got = ids(ds)
        seen.update(got)
        per_reader.append(tally["bytes"])
    assert seen == Counter(range(ROWS))  # every record once
    share = size / readers
    print(f"{readers} readers of {size} bytes: bytes read per reader {per_reader} (share {share:.0f})")
    tails = (4 + 1) * TAIL_READ  # per piece: the read that finishes its last record; and the header
    assert max(per_reader) < share * 1.05 + tails


def test_one_jsonl_file_many_readers_reads_about_a_share_each(
    tmp_path, tally, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("vertexrt.data.formats.base.MIN_PIECE_BYTES", 256 << 10)
    uri = str(tmp_path / "big.jsonl")
    with open(uri, "w") as f:
        f.writelines(json.dumps({"id": i, "text": "y" * (i % 300)}) + "\n" for i in range(ROWS))
    readers, seen, per_reader = 4, Counter[int](), []
    for rank in range(readers):
        tally.clear()
        ds = open_dataset(uri, seed=3, shuffle_buffer=1, rank=rank, world_size=readers, equalize=None)
        seen.update(ids(ds))
        per_reader.append(tally["bytes"])
    assert seen == Counter(range(ROWS))  # every record once
    assert max(per_reader) < os.path.getsize(uri) / readers * 1.05 + (4 + 1) * TAIL_READ, per_reader


def test_equalized_split_file_resumes_on_another_world_size(big_csv: str) -> None:
    def reader(rank: int, world: int) -> Any:
        ds = open_dataset(big_csv, seed=3, shuffle_buffer=1, rank=rank, world_size=world)
        ds.set_epoch(1)
        return ds

    seen: Counter[int] = Counter()
    states = []
    for rank in range(4):
        ds = reader(rank, 4)
        it = iter(ds)
        seen.update(int(next(it)["id"]) for _ in range([1000, 2000, 3000, 3000][rank]))
        states.append(json.loads(json.dumps(ds.state_dict())))
    state = merge_states(states)
    for rank in range(3):
        ds = reader(rank, 3)
        ds.load_state_dict(state)
        ds.set_epoch(1)
        seen.update(ids(ds))
    assert seen == Counter(range(ROWS))  # 60000 and the 51000 left divide by 4 and 3: none dropped


def test_exact_resume_inside_a_piece(big_csv: str) -> None:
    whole = ids(open_dataset(big_csv, seed=1, shuffle_buffer=50, rank=1, world_size=4, equalize=None))
    ds = open_dataset(big_csv, seed=1, shuffle_buffer=50, rank=1, world_size=4, equalize=None)
    it = iter(ds)
    head = [int(next(it)["id"]) for _ in range(7777)]
    again = open_dataset(big_csv, seed=1, shuffle_buffer=50, rank=1, world_size=4, equalize=None)
    again.load_state_dict(json.loads(json.dumps(ds.state_dict())))
    assert head + ids(again) == whole


def test_a_quoted_newline_across_a_cut_is_an_error(tmp_path) -> None:
    uri = str(tmp_path / "quoted.csv")
    with open(uri, "w") as f:
        f.write("id,text\n" + "".join(f'{i},"{"x" * 400}\nend"\n' for i in range(12_000)))
    with pytest.raises(DataError, match="quoted CSV field holding a newline crosses byte"):
        for rank in range(4):
            ids(open_dataset(uri, format=CSV(), rank=rank, world_size=4, equalize=None))


def test_gzip_files_stay_whole(tmp_path, tally) -> None:
    import gzip

    uri = str(tmp_path / "big.csv.gz")
    with gzip.open(uri, "wt") as f:
        f.write("id\n" + "".join(f"{i}\n" for i in range(300_000)))
    seen: Counter[int] = Counter()
    for rank in range(2):
        seen.update(ids(open_dataset(uri, rank=rank, world_size=2, equalize=None)))
    assert seen == Counter(range(300_000))


# -- TFRecord: byte ranges, the first record of a piece found by its framing ----------------------------


def tfrecord_payloads(count: int) -> list[bytes]:
    """Unique payloads (id at the end), many holding bytes that look like a record header (a length and
    its CRC), a whole framed record, or a run of zeros."""
    import random
    import struct

    from vertexrt.data.formats.tfrecord import encode_record, masked_crc32c

    rng = random.Random(5)
    out = []
    for i in range(count):
        body = rng.randbytes(rng.randrange(0, 1200))
        kind = i % 4
        if kind == 1:  # a fake header: 8 length bytes and their masked CRC
            length = struct.pack("<Q", rng.randrange(0, 64))
            body += length + struct.pack("<I", masked_crc32c(length)) + rng.randbytes(rng.randrange(0, 80))
        elif kind == 2:  # a whole framed record inside the payload
            body = encode_record(rng.randbytes(rng.randrange(0, 200))) + body
        elif kind == 3:
            body += bytes(rng.randrange(0, 3000))
        out.append(body + b"#%06d" % i)
    return out


@pytest.fixture
def big_tfrecord(tmp_path) -> tuple[str, list[bytes]]:
    from vertexrt.data import TFRecordWriter

    uri = str(tmp_path / "big.tfrecord")
    payloads = tfrecord_payloads(3000)
    with TFRecordWriter(uri) as writer:
        for payload in payloads:
            writer.write(payload)
    return uri, payloads


@pytest.mark.parametrize("readers", [2, 3, 7, 16])
def test_tfrecord_pieces_hold_every_record_once(
    big_tfrecord: tuple[str, list[bytes]], readers: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("vertexrt.data.formats.base.MIN_PIECE_BYTES", 16 << 10)
    uri, payloads = big_tfrecord
    seen: Counter[bytes] = Counter()
    for rank in range(readers):
        seen.update(open_dataset(uri, seed=4, shuffle_buffer=1, rank=rank, world_size=readers, equalize=None))
    assert seen == Counter(payloads)


def test_tfrecord_reader_reads_about_a_share(
    big_tfrecord: tuple[str, list[bytes]], tally, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("vertexrt.data.formats.base.MIN_PIECE_BYTES", 64 << 10)
    uri, payloads = big_tfrecord
    readers, size, seen, per_reader = 4, os.path.getsize(uri), Counter[bytes](), []
    for rank in range(readers):
        tally.clear()
        seen.update(open_dataset(uri, seed=4, shuffle_buffer=1, rank=rank, world_size=readers, equalize=None))
        per_reader.append(tally["bytes"])
    assert seen == Counter(payloads)
    record = max(len(p) for p in payloads) + 16
    # per piece (4 per reader): finding its first record, reading past its end, checking the next piece's
    # first record: each a small read plus a record or two
    assert max(per_reader) < size / readers * 1.05 + 4 * 3 * (TAIL_READ + 2 * record), (size, per_reader)


@pytest.mark.parametrize("equalize", [None, "drop_remainder"])
def test_tfrecord_exact_resume_inside_a_piece(
    big_tfrecord: tuple[str, list[bytes]], equalize: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("vertexrt.data.formats.base.MIN_PIECE_BYTES", 16 << 10)
    uri, _ = big_tfrecord

    def reader() -> Any:
        return open_dataset(uri, seed=1, shuffle_buffer=50, rank=1, world_size=4, equalize=equalize)

    whole = list(reader())
    ds = reader()
    it = iter(ds)
    head = [next(it) for _ in range(333)]
    again = reader()
    again.load_state_dict(json.loads(json.dumps(ds.state_dict())))
    assert head + list(again) == whole and len(whole) > 600


def test_tfrecord_payloads_holding_framed_records_are_an_error_not_duplicates(
    tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from vertexrt.data import TFRecordWriter
    from vertexrt.data.formats.tfrecord import encode_record

    monkeypatch.setattr("vertexrt.data.formats.base.MIN_PIECE_BYTES", 16 << 10)
    uri = str(tmp_path / "nested.tfrecord")
    inner = b"".join(encode_record(b"inner %d" % i) for i in range(400))  # a TFRecord file as a payload
    with TFRecordWriter(uri) as writer:
        for i in range(20):
            writer.write(inner + b"%d" % i)
    with pytest.raises(DataError, match="cannot be read in byte ranges"):
        for rank in range(8):
            list(open_dataset(uri, rank=rank, world_size=8, equalize=None))


def test_compressed_tfrecord_is_read_whole(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    from vertexrt.data import TFRecord, TFRecordWriter
    from vertexrt.data.formats.base import FileSource

    monkeypatch.setattr("vertexrt.data.formats.base.MIN_PIECE_BYTES", 1 << 10)
    uri = str(tmp_path / "big.tfrecord.gz")
    payloads = tfrecord_payloads(500)
    with TFRecordWriter(uri) as writer:
        for payload in payloads:
            writer.write(payload)
    assert TFRecord().split(FileSource(uri, os.path.getsize(uri)), 8, False) is None
    seen: Counter[bytes] = Counter()
    for rank in range(3):
        seen.update(open_dataset(uri, rank=rank, world_size=3, equalize=None))
    assert seen == Counter(payloads)


# -- Parquet: pieces of whole row groups ----------------------------------------------------------------

PQ_ROWS = 20_000


def write_parquet(uri: str, rows: int = PQ_ROWS, group: int = 2_000) -> str:
    import random

    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = random.Random(9)
    table = pa.table({"id": range(rows), "text": [rng.randbytes(40).hex() for _ in range(rows)]})
    with paths.open(uri, "wb") as f:
        pq.write_table(table, f, row_group_size=group, compression="none")
    return uri


def row_ids(ds: Any, columnar: bool) -> list[int]:
    if columnar:
        return [int(i) for batch in ds for i in batch["id"]]
    return [int(r["id"]) for r in ds]


@pytest.mark.parametrize("columnar", [False, True])
@pytest.mark.parametrize("readers", [2, 3, 7])
def test_parquet_row_group_pieces_hold_every_row_once(tmp_path, readers: int, columnar: bool) -> None:
    uri = write_parquet(str(tmp_path / "one.parquet"))
    seen: Counter[int] = Counter()
    for rank in range(readers):
        ds = open_dataset(
            uri, seed=2, shuffle_buffer=1, rank=rank, world_size=readers, equalize=None,
            columnar=columnar, batch_size=64,
        )  # fmt: skip
        assert len(ds._order(readers)) > 1  # cut into pieces
        seen.update(row_ids(ds, columnar))
    assert seen == Counter(range(PQ_ROWS))


def test_parquet_pieces_are_whole_row_groups(tmp_path) -> None:
    from vertexrt.data import Parquet
    from vertexrt.data.formats.base import FileSource

    uri = write_parquet(str(tmp_path / "one.parquet"))
    source = FileSource(uri, os.path.getsize(uri))
    assert Parquet().split(source, 4, False) == [(0, 6000), (6000, 10000), (10000, 16000), (16000, 20000)]
    assert Parquet().split(source, 50, True) == [(i, i + 2000) for i in range(0, PQ_ROWS, 2000)]
    single = write_parquet(str(tmp_path / "single.parquet"), rows=5_000, group=5_000)
    assert Parquet().split(FileSource(single, os.path.getsize(single)), 4, False) is None


@pytest.fixture
def gcs_parquet(gcs_server: Any) -> str:
    """A Parquet file of 10 row groups on the GCS server (written before ``tally`` counts reads)."""
    return write_parquet(f"gs://{gcs_server.bucket}/split-{uuid.uuid4().hex}/one.parquet")


def test_parquet_reader_reads_only_its_row_groups(gcs_parquet: str, tally) -> None:
    uri = gcs_parquet
    fs, path = paths.filesystem(uri)
    size = fs.size(path)
    readers, seen, per_reader = 4, Counter[int](), []
    for rank in range(readers):
        tally.clear()
        ds = open_dataset(uri, shuffle=False, rank=rank, world_size=readers, equalize=None)
        seen.update(row_ids(ds, False))
        per_reader.append(tally["bytes"])
    assert seen == Counter(range(PQ_ROWS))
    # 10 row groups (10 pieces), at most 3 per reader, each piece opened with a read of the footer (and
    # one more to cut the file, once per process)
    footer = 72 << 10  # Arrow reads the last 64 KiB, and more if the footer is longer
    assert max(per_reader) < size * 0.3 + 4 * footer, (size, per_reader)
    assert sum(per_reader) < size + 11 * footer, (size, per_reader)  # the file once in all


@pytest.mark.parametrize("columnar", [False, True])
@pytest.mark.parametrize("equalize", [None, "drop_remainder"])
def test_parquet_exact_resume_inside_a_piece(tmp_path, columnar: bool, equalize: Any) -> None:
    uri = write_parquet(str(tmp_path / "one.parquet"))

    def reader() -> Any:
        return open_dataset(
            uri, seed=1, shuffle_buffer=300, rank=1, world_size=3, equalize=equalize, columnar=columnar,
            batch_size=50,
        )  # fmt: skip

    whole = row_ids(reader(), columnar)
    ds = reader()
    it = iter(ds)
    head = [next(it) for _ in range(41)]
    again = reader()
    again.load_state_dict(json.loads(json.dumps(ds.state_dict())))
    assert row_ids(head, columnar) + row_ids(again, columnar) == whole and len(whole) > 5000


@pytest.mark.parametrize("on_error", ["raise", "skip"])
def test_tfrecord_corruption_in_a_split_file_is_reported_never_duplicated(
    tmp_path, on_error: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from vertexrt.data import TFRecordWriter

    monkeypatch.setattr("vertexrt.data.formats.base.MIN_PIECE_BYTES", 16 << 10)
    uri = str(tmp_path / "damaged.tfrecord")
    payloads = [b"%05d" % i + bytes(300) for i in range(1000)]  # 321 bytes a record
    with TFRecordWriter(uri) as writer:
        for payload in payloads:
            writer.write(payload)
    with open(uri, "r+b") as f:
        for record in (7, 200, 201, 555, 999):  # a flipped byte in each header's length CRC
            f.seek(record * 321 + 9)
            f.write(b"\xee")
    seen: Counter[bytes] = Counter()
    skipped = 0
    try:
        for rank in range(7):
            ds = open_dataset(uri, rank=rank, world_size=7, equalize=None, on_error=on_error)  # type: ignore[arg-type]
            seen.update(ds)
            skipped += ds.skipped
    except DataError as err:
        assert on_error == "raise" and "corrupted record" in str(err)
        return
    assert on_error == "skip" and skipped >= 4 and set(seen.values()) == {1}
    assert set(seen) <= set(payloads) and len(seen) > 500


def test_tfrecord_damaged_record_at_a_cut_is_a_bad_record(tmp_path) -> None:
    from vertexrt.data import TFRecord, TFRecordWriter
    from vertexrt.data.formats.base import Errors, FileSource

    uri = str(tmp_path / "cut.tfrecord")
    payloads = [b"%05d" % i + bytes(300) for i in range(12_000)]  # 321 bytes a record
    with TFRecordWriter(uri) as writer:
        for payload in payloads:
            writer.write(payload)
    source = FileSource(uri, os.path.getsize(uri))
    pieces = TFRecord().split(source, 3, False)
    assert pieces is not None and len(pieces) == 3
    damaged = -(-pieces[1][0] // 321)  # the first record of the second piece
    with open(uri, "r+b") as f:
        f.seek(damaged * 321 + 9)
        f.write(b"\xee")
    errors = Errors("skip")
    got = [
        p for start, end in pieces for _, raws in TFRecord().read(source, start, end, errors) for p in raws
    ]
    assert got == payloads[:damaged] + payloads[damaged + 1 :] and errors.skipped == 1
    with pytest.raises(DataError, match=f"corrupted record at byte {damaged * 321}"):
        for start, end in pieces:
            list(TFRecord().read(source, start, end, Errors("raise")))


@pytest.mark.parametrize("kind", ["tfrecord", "parquet"])
def test_split_tfrecord_and_parquet_resume_on_another_world_size(
    big_tfrecord: tuple[str, list[bytes]], tmp_path, kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("vertexrt.data.formats.base.MIN_PIECE_BYTES", 16 << 10)
    expected: Counter[Any]
    if kind == "tfrecord":
        uri, expected = big_tfrecord[0], Counter(big_tfrecord[1])
    else:
        uri, expected = write_parquet(str(tmp_path / "one.parquet"), 6000, 500), Counter(range(6000))

    def reader(rank: int, world: int) -> Any:
        ds = open_dataset(uri, seed=3, shuffle_buffer=1, rank=rank, world_size=world)
        ds.set_epoch(1)
        return ds

    def key(record: Any) -> Any:
        return record if kind == "tfrecord" else record["id"]

    seen: Counter[Any] = Counter()
    states = []
    for rank in range(4):
        ds = reader(rank, 4)
        it = iter(ds)
        seen.update(key(next(it)) for _ in range([100, 200, 300, 300][rank]))
        states.append(json.loads(json.dumps(ds.state_dict())))
    state = merge_states(states)
    for rank in range(3):
        ds = reader(rank, 3)
        ds.load_state_dict(state)
        ds.set_epoch(1)
        seen.update(key(r) for r in ds)
    assert seen == expected  # 3000 / 6000 and what is left divide by 4 and 3: none dropped


def test_tfrecord_records_longer_than_a_piece(tmp_path, tally) -> None:
    from vertexrt.data import TFRecordWriter

    uri = str(tmp_path / "long.tfrecord")
    payloads = [os.urandom(3 << 20) + b"%d" % i for i in range(6)]  # 18 MiB: 16 pieces of 1 MiB
    with TFRecordWriter(uri) as writer:
        for payload in payloads:
            writer.write(payload)
    seen: Counter[bytes] = Counter()
    for rank in range(4):
        tally.clear()
        seen.update(open_dataset(uri, shuffle=False, rank=rank, world_size=4, equalize=None))
        # 4 pieces: each finds its first record, finishes the one crossing its end, checks the next
        assert tally["bytes"] < os.path.getsize(uri) / 4 + 4 * 3 * (3 << 20), tally
    assert seen == Counter(payloads)

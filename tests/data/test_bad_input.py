"""Bad input: every failure is a VertexrtError naming what and where; on_error="skip" skips and counts."""

from __future__ import annotations

import pytest

from vertexrt import paths
from vertexrt.data import TFRecordWriter, open_dataset
from vertexrt.errors import DataError, PathError

from .conftest import read_all, write_bytes


def tfrecord_file(root: str, n: int = 6, size: int = 40) -> tuple[str, bytes]:
    uri = paths.join(root, "c.tfrecord")
    with TFRecordWriter(uri) as writer:
        for i in range(n):
            writer.write(bytes([i]) * size)
    with paths.open(uri, "rb") as f:
        return uri, f.read()


def test_tfrecord_flipped_payload_byte(storage_root: str) -> None:
    uri, data = tfrecord_file(storage_root)
    record = 12 + 40 + 4
    corrupt = bytearray(data)
    corrupt[2 * record + 20] ^= 0x01  # inside record 2's payload
    write_bytes(uri, bytes(corrupt))
    with pytest.raises(DataError, match=rf"c\.tfrecord: corrupted record at byte {2 * record} \(payload CRC"):
        read_all(uri)
    ds = open_dataset(uri, shuffle=False, on_error="skip", rank=0, world_size=1)
    assert list(ds) == [bytes([i]) * 40 for i in (0, 1, 3, 4, 5)]
    assert ds.skipped == 1


def test_tfrecord_flipped_length_byte_skips_rest_of_file(storage_root: str) -> None:
    uri, data = tfrecord_file(storage_root)
    corrupt = bytearray(data)
    corrupt[3 * 56 + 1] ^= 0x10  # record 3's length field
    write_bytes(uri, bytes(corrupt))
    with pytest.raises(DataError, match=r"corrupted record at byte 168 \(length CRC"):
        read_all(uri)
    ds = open_dataset(uri, shuffle=False, on_error="skip", rank=0, world_size=1)
    assert list(ds) == [bytes([i]) * 40 for i in range(3)] and ds.skipped == 1


def test_tfrecord_truncated_tail(storage_root: str) -> None:
    uri, data = tfrecord_file(storage_root)
    write_bytes(uri, data[:-10])
    with pytest.raises(DataError, match=r"c\.tfrecord: truncated record at byte 280"):
        read_all(uri)
    ds = open_dataset(uri, shuffle=False, on_error="skip", rank=0, world_size=1)
    assert len(list(ds)) == 5 and ds.skipped == 1


def test_truncated_gzip_stream(storage_root: str) -> None:
    import gzip

    uri = paths.join(storage_root, "t.jsonl.gz")
    blob = gzip.compress(b"".join(b'{"i": %d}\n' % i for i in range(5000)))
    write_bytes(uri, blob[: len(blob) // 2])
    with pytest.raises(DataError, match=r"t\.jsonl\.gz: compressed stream ends early"):
        read_all(uri)


def test_malformed_json_line_names_file_and_line(storage_root: str) -> None:
    uri = paths.join(storage_root, "m.jsonl")
    write_bytes(uri, b'{"a": 1}\n\n{"a": 2}\n{"a": 3,,}\n{"a": 4}\n')
    with pytest.raises(DataError, match=r"m\.jsonl:4 \(byte 19\): malformed JSON line"):
        read_all(uri)
    ds = open_dataset(uri, shuffle=False, on_error="skip", rank=0, world_size=1)
    assert list(ds) == [{"a": 1}, {"a": 2}, {"a": 4}] and ds.skipped == 1


def test_csv_row_with_wrong_column_count(storage_root: str) -> None:
    uri = paths.join(storage_root, "w.csv")
    write_bytes(uri, b"a,b,c\n1,2,3\n4,5\n6,7,8\n")
    with pytest.raises(DataError, match=r"w\.csv:3 \(byte 12\): CSV row has 2 columns, the header has 3"):
        read_all(uri)
    ds = open_dataset(uri, shuffle=False, on_error="skip", rank=0, world_size=1)
    assert list(ds) == [{"a": "1", "b": "2", "c": "3"}, {"a": "6", "b": "7", "c": "8"}] and ds.skipped == 1


def test_wildcard_matching_nothing(storage_root: str) -> None:
    with pytest.raises(DataError, match=r"no file matches .*training-\*\.jsonl"):
        open_dataset(paths.join(storage_root, "training-*.jsonl"))


def test_missing_path(storage_root: str) -> None:
    with pytest.raises(DataError, match="does not exist"):
        open_dataset(paths.join(storage_root, "nope.jsonl"))


def test_unreadable_bucket(gcs_server) -> None:
    with pytest.raises(DataError, match=r"no-such-bucket-vx.*check the bucket name"):
        open_dataset("gs://no-such-bucket-vx/data/*.jsonl")
    with pytest.raises(DataError, match=r"no-such-bucket-vx.*check the bucket name"):
        open_dataset("gs://no-such-bucket-vx/data/train.jsonl")
    with pytest.raises(PathError, match="invalid bucket name"):
        open_dataset("gs://Bad_Bucket/x.jsonl")


@pytest.mark.parametrize(
    "uri",
    [
        "bq://",
        "bq://project",
        "bq://project.dataset",
        "bq://Project.d.t",
        "bq://p.d.t.extra",
        "bq://p.da-ta.t",
    ],
)
def test_malformed_bigquery_uri(uri: str) -> None:
    with pytest.raises(PathError, match="not a BigQuery table: expected bq://PROJECT.DATASET.TABLE"):
        open_dataset(uri)


def test_empty_files(storage_root: str) -> None:
    empty = write_bytes(paths.join(storage_root, "e.jsonl"), b"")
    with pytest.raises(DataError, match="is empty"):
        open_dataset(empty)
    write_bytes(paths.join(storage_root, "f.jsonl"), b'{"a": 1}\n')
    assert read_all(paths.join(storage_root, "*.jsonl")) == [{"a": 1}]  # an empty shard among others is fine
    empty_csv = write_bytes(paths.join(storage_root, "e.csv"), b"a,b\n")
    assert read_all(empty_csv) == []  # a header and no rows: no records


def test_unknown_format_and_bad_options(tmp_path) -> None:
    (tmp_path / "x.bin").write_bytes(b"x")
    from vertexrt.errors import ConfigError

    with pytest.raises(ConfigError, match="cannot tell the data format"):
        open_dataset(str(tmp_path / "x.bin"))
    with pytest.raises(DataError, match="unknown data format 'xml'"):
        open_dataset(str(tmp_path / "x.bin"), format="xml")
    with pytest.raises(DataError, match="on_error='ignore'"):
        open_dataset(str(tmp_path / "x.bin"), format="jsonl", on_error="ignore")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="equalize='trim'"):
        open_dataset(str(tmp_path / "x.bin"), format="jsonl", equalize="trim")  # type: ignore[arg-type]


@pytest.mark.slow
def test_error_in_a_dataloader_worker_reaches_the_training_loop(tmp_path) -> None:
    torch = pytest.importorskip("torch")
    path = tmp_path / "bad.jsonl"
    path.write_bytes(b'{"a": 1}\n' * 3 + b"nope\n")
    ds = open_dataset(str(path), shuffle=False, rank=0, world_size=1).as_torch()
    loader = torch.utils.data.DataLoader(ds, batch_size=2, num_workers=1, timeout=60)
    with pytest.raises(DataError, match=r"bad\.jsonl:4"):
        list(loader)

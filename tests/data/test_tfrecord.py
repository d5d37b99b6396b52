"""TFRecord: known-answer vectors, vertexrt <-> TensorFlow both ways (plain, GZIP), tf.train.Example."""

from __future__ import annotations

import os

import pytest

from vertexrt import paths
from vertexrt.data import TFRecord, TFRecordWriter, decode_example, encode_example, open_dataset
from vertexrt.data.tfrecord import encode_record, masked_crc32c

PAYLOADS = [b"", b"hello", bytes(32), os.urandom(1000), os.urandom(70_000), b"\x00\xff" * 9]


def test_known_answer_vectors() -> None:
    assert encode_record(b"") == bytes.fromhex("000000000000000029039807d8ea82a2")
    assert encode_record(b"hello") == bytes.fromhex("0500000000000000eab2043e68656c6c6fbb1f1c19")
    zeros = encode_record(bytes(32))
    assert zeros[:12] == bytes.fromhex("200000000000000029eda950")
    assert zeros[-4:] == bytes.fromhex("faffd70f")


def test_crc32c_check_value() -> None:
    from google_crc32c import value

    assert value(b"123456789") == 0xE3069283
    assert masked_crc32c(b"") == 0xA282EAD8


@pytest.mark.parametrize("compression", ["", "GZIP", "ZLIB"])
def test_writer_reader_roundtrip(storage_root: str, compression: str) -> None:
    uri = paths.join(storage_root, f"x.tfrecord{'.gz' if compression == 'GZIP' else ''}")
    with TFRecordWriter(uri, compression=compression or None) as writer:
        for payload in PAYLOADS:
            writer.write(payload)
    ds = open_dataset(
        uri, format=TFRecord(compression=compression or None), shuffle=False, rank=0, world_size=1
    )
    assert list(ds) == PAYLOADS


@pytest.mark.parametrize("compression", ["", "GZIP"])
def test_reads_files_written_by_tensorflow(tmp_path, storage_root: str, compression: str) -> None:
    tf = pytest.importorskip("tensorflow")
    local = str(tmp_path / "tf.tfrecord")
    with tf.io.TFRecordWriter(local, options=tf.io.TFRecordOptions(compression_type=compression)) as writer:
        for payload in PAYLOADS:
            writer.write(payload)
    uri = paths.join(storage_root, "from-tf.tfrecord")
    with open(local, "rb") as src, paths.open(uri, "wb") as dst:
        dst.write(src.read())
    ds = open_dataset(uri, format=TFRecord(compression=compression), shuffle=False, rank=0, world_size=1)
    assert list(ds) == PAYLOADS


@pytest.mark.parametrize("compression", ["", "GZIP", "ZLIB"])
def test_tensorflow_reads_vertexrt_files(tmp_path, storage_root: str, compression: str) -> None:
    tf = pytest.importorskip("tensorflow")
    uri = paths.join(storage_root, "ours.tfrecord")
    with TFRecordWriter(uri, compression=compression) as writer:
        for payload in PAYLOADS:
            writer.write(payload)
    local = str(tmp_path / "ours.tfrecord")
    with paths.open(uri, "rb") as src, open(local, "wb") as dst:
        dst.write(src.read())
    got = [bytes(t.numpy()) for t in tf.data.TFRecordDataset(local, compression_type=compression)]
    assert got == PAYLOADS


def test_example_decoding_matches_tensorflow(tmp_path) -> None:
    tf = pytest.importorskip("tensorflow")
    feature = tf.train.Feature
    example = tf.train.Example(
        features=tf.train.Features(
            feature={
                "label": feature(int64_list=tf.train.Int64List(value=[3, -7, 2**40])),
                "x": feature(float_list=tf.train.FloatList(value=[0.5, -2.25])),
                "name": feature(bytes_list=tf.train.BytesList(value=[b"a", b"\xffb"])),
                "empty": feature(int64_list=tf.train.Int64List(value=[])),
            }
        )
    )
    payload = example.SerializeToString()
    assert decode_example(payload) == {
        "label": [3, -7, 2**40],
        "x": [0.5, -2.25],
        "name": [b"a", b"\xffb"],
        "empty": [],
    }
    ours = encode_example({"label": [3, -7], "x": [0.5], "name": [b"a", "b"]})
    parsed = tf.train.Example.FromString(ours)
    assert list(parsed.features.feature["label"].int64_list.value) == [3, -7]
    assert list(parsed.features.feature["x"].float_list.value) == [0.5]
    assert list(parsed.features.feature["name"].bytes_list.value) == [b"a", b"b"]


def test_example_records_through_the_dataset(storage_root: str) -> None:
    uri = paths.join(storage_root, "ex.tfrecord")
    with TFRecordWriter(uri) as writer:
        for i in range(10):
            writer.write(encode_example({"i": [i], "f": [i / 2], "s": [f"r{i}".encode()]}))
    ds = open_dataset(uri, format=TFRecord(example=True), shuffle=False, rank=0, world_size=1)
    assert list(ds) == [{"i": [i], "f": [i / 2], "s": [f"r{i}".encode()]} for i in range(10)]


def test_large_records_span_read_chunks(tmp_path) -> None:
    uri = str(tmp_path / "big.tfrecord")
    payloads = [os.urandom(3 << 20) for _ in range(5)]
    with TFRecordWriter(uri) as writer:
        for payload in payloads:
            writer.write(payload)
    assert list(open_dataset(uri, shuffle=False, rank=0, world_size=1)) == payloads

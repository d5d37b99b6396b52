"""TFRecord: known-answer vectors, vertexrt <-> TensorFlow both ways (plain, GZIP), tf.train.Example."""

from __future__ import annotations

import os

import pytest

from vertexrt import paths
from vertexrt.data import TFRecord, TFRecordWriter, decode_example, encode_example, open_dataset
from vertexrt.data.formats.tfrecord import encode_record, masked_crc32c

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


@pytest.mark.parametrize("kind", ["int64", "float32", "string"])
def test_an_empty_feature_parses_under_any_declared_type(kind: str) -> None:
    tf = pytest.importorskip("tensorflow")
    dtype = getattr(tf, kind)
    payload = encode_example({"f": [], "g": [1]})
    assert decode_example(payload) == {"f": [], "g": [1]}
    parsed = tf.io.parse_example([payload], {"f": tf.io.VarLenFeature(dtype)})
    assert parsed["f"].values.dtype == dtype and parsed["f"].values.shape == (0,)
    ragged = tf.io.parse_example([payload], {"f": tf.io.RaggedFeature(dtype)})
    assert ragged["f"].to_list() == [[]]


def test_runs_of_equal_length_records_keep_every_check(tmp_path) -> None:
    """Records of one length are framed a run at a time: a bad payload CRC, a bad footer and a change of
    length inside a run are each found at their exact byte, with every other record handed out in order."""
    from collections import Counter

    from vertexrt.errors import DataError

    payloads = [i.to_bytes(2, "big") * 50 for i in range(600)]
    payloads[300] = b"short"
    frames = [bytearray(encode_record(p)) for p in payloads]
    frames[150][12 + 7] ^= 1  # payload byte
    frames[400][-1] ^= 1  # footer
    offsets = [sum(map(len, frames[:i])) for i in range(len(frames))]
    uri = str(tmp_path / "runs.tfrecord")
    with open(uri, "wb") as f:
        f.write(b"".join(frames))
    good = [p for i, p in enumerate(payloads) if i not in (150, 400)]
    ds = open_dataset(uri, shuffle=False, rank=0, world_size=1, on_error="skip")
    assert list(ds) == good and ds.skipped == 2
    with pytest.raises(DataError, match=f"byte {offsets[150]} \\(payload CRC"):
        list(open_dataset(uri, shuffle=False, rank=0, world_size=1))
    seen: Counter[bytes] = Counter()  # byte-range pieces: every good record once
    for rank in range(3):
        piece = open_dataset(uri, shuffle=False, rank=rank, world_size=3, equalize=None, on_error="skip")
        seen.update(piece)
    assert seen == Counter(good)
    frames[500][0] ^= 1  # a length that fails its CRC: the rest of the file is skipped
    with open(uri, "wb") as f:
        f.write(b"".join(frames))
    ds = open_dataset(uri, shuffle=False, rank=0, world_size=1, on_error="skip")
    assert list(ds) == good[:498] and ds.skipped == 3
    with pytest.raises(DataError, match=f"byte {offsets[150]} "):
        list(open_dataset(uri, shuffle=False, rank=0, world_size=1))

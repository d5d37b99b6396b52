"""The tf.data adapter in a real tf.data pipeline."""

from __future__ import annotations

import pytest

from vertexrt import paths
from vertexrt.data import CSV, TFRecordWriter, encode_example, open_dataset

tf = pytest.importorskip("tensorflow")


def test_jsonl_to_tf_data_with_inferred_signature(storage_root: str, write_jsonl) -> None:
    uri = paths.join(storage_root, "t.jsonl")
    write_jsonl(uri, [{"x": i / 2, "label": i % 3, "name": f"n{i}"} for i in range(50)])
    ds = open_dataset(uri, shuffle=False, rank=0, world_size=1).as_tf()
    batches = list(ds.batch(16).map(lambda r: (r["x"] * 2.0, r["label"], r["name"])).prefetch(2))
    assert [len(b[0]) for b in batches] == [16, 16, 16, 2]
    xs = tf.concat([b[0] for b in batches], 0).numpy().tolist()
    assert xs == [float(i) for i in range(50)]
    assert tf.concat([b[2] for b in batches], 0).numpy().tolist()[:2] == [b"n0", b"n1"]


def test_tfrecord_examples_parsed_by_tf_io(tmp_path) -> None:
    uri = str(tmp_path / "e.tfrecord")
    with TFRecordWriter(uri) as writer:
        for i in range(20):
            writer.write(encode_example({"i": [i], "v": [1.5 * i]}))
    ds = open_dataset(uri, shuffle=False, rank=0, world_size=1).as_tf()
    spec = {"i": tf.io.FixedLenFeature([], tf.int64), "v": tf.io.FixedLenFeature([], tf.float32)}
    parsed = ds.batch(8).map(lambda b: tf.io.parse_example(b, spec))
    got = [int(i) for batch in parsed for i in batch["i"].numpy()]
    assert got == list(range(20))


def test_explicit_signature_and_a_shuffled_csv(tmp_path) -> None:
    uri = str(tmp_path / "c.csv")
    with open(uri, "w") as f:
        f.write("a,b\n" + "".join(f"{i},{i * i}\n" for i in range(30)))
    ds = open_dataset(
        uri, format=CSV(types={"a": int, "b": int}), seed=3, shuffle_buffer=7, rank=0, world_size=1
    )
    signature = {"a": tf.TensorSpec((), tf.int64), "b": tf.TensorSpec((), tf.int64)}
    rows = [(int(r["a"]), int(r["b"])) for r in ds.as_tf(signature)]
    assert sorted(rows) == [(i, i * i) for i in range(30)] and rows != sorted(rows)


def test_a_pass_cut_short_leaves_the_next_pass_whole(tmp_path, write_jsonl) -> None:
    """A Keras validation pass stops at the cardinality (or a take()); the next pass of the same
    tf.data dataset still holds the asserted number of elements (it starts at an epoch start)."""
    uri = write_jsonl(str(tmp_path / "v.jsonl"), [{"x": i} for i in range(40)])
    ds = open_dataset(uri, shuffle=False, rank=0, world_size=2, prefetch=0)  # equalized: 20 each
    data = ds.as_tf()
    assert int(data.cardinality()) == 20
    assert [int(r["x"]) for r in data.take(3)] == [0, 1, 2]
    assert [int(r["x"]) for r in data] == list(range(20))
    assert [int(b["x"].shape[0]) for b in data.batch(8)] == [8, 8, 4]


def test_one_worker_validation_set_knows_its_cardinality_with_drop_remainder(tmp_path, write_jsonl) -> None:
    """What the README says for a validation set read by one worker: unknown length by default (Keras reads
    until the data runs out, warning each epoch); equalize="drop_remainder" counts it and carries it."""
    uri = write_jsonl(str(tmp_path / "val.jsonl"), [{"x": i} for i in range(30)])
    plain = open_dataset(uri, shuffle=False, rank=0, world_size=1).as_tf().batch(8)
    assert int(plain.cardinality()) == int(tf.data.UNKNOWN_CARDINALITY)
    counted = open_dataset(uri, shuffle=False, rank=0, world_size=1, equalize="drop_remainder").as_tf()
    assert int(counted.batch(8).cardinality()) == 4 and int(counted.cardinality()) == 30

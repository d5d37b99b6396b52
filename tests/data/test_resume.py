"""Exact resume: stop at random points, resume in a fresh process, the concatenation equals the stream."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from typing import Any

import pytest

from vertexrt import paths
from vertexrt.data import TFRecordWriter, open_dataset

_RESUME = r"""
import json, sys
from vertexrt.data import CSV, JSONL, TFRecord, open_dataset
spec = json.loads(sys.stdin.read())
out = []
for state in spec["states"]:
    ds = open_dataset(spec["uri"], format=eval(spec["format"]), **spec["options"])
    ds.load_state_dict(state)
    ds.set_epoch(state["epoch"])
    out.append([r["id"] if isinstance(r, dict) else r.decode() for r in ds])
print(json.dumps(out))
"""


def key(record: Any) -> Any:
    return record["id"] if isinstance(record, dict) else record.decode()


def resume_in_fresh_process(uri: str, fmt: str, options: dict[str, Any], states: list[dict[str, Any]]) -> Any:
    spec = json.dumps({"uri": uri, "format": fmt, "options": options, "states": states})
    done = subprocess.run(
        [sys.executable, "-c", _RESUME], input=spec, capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def check_resume(uri: str, fmt: str, options: dict[str, Any], epoch: int = 1, stops: int = 4) -> None:
    from vertexrt.data import CSV, JSONL, TFRecord

    def fresh() -> Any:
        ds = open_dataset(
            uri, format=eval(fmt, {"CSV": CSV, "JSONL": JSONL, "TFRecord": TFRecord}), **options
        )
        ds.set_epoch(epoch)
        return ds

    full = [key(r) for r in fresh()]
    assert full, "no records"
    rng = random.Random(len(full))
    points = sorted({0, 1, len(full) - 1, len(full), *rng.sample(range(len(full)), min(stops, len(full)))})
    states = []
    for stop in points:
        ds = fresh()
        it = iter(ds)
        for _ in range(stop):
            next(it)
        states.append(json.loads(json.dumps(ds.state_dict())))
        del it
    rests = resume_in_fresh_process(uri, fmt, options, states)
    for stop, state, rest in zip(points, states, rests, strict=True):
        assert full[:stop] + rest == full, f"stop={stop} state={state}"
        assert len(json.dumps(state)) < 600  # O(1): a cursor, never a buffer


@pytest.mark.slow
@pytest.mark.parametrize("shuffle", [True, False])
def test_resume_jsonl_shuffled_and_plain(storage_root: str, id_files, shuffle: bool) -> None:
    id_files(storage_root)
    options = {"shuffle": shuffle, "seed": 4, "shuffle_buffer": 16, "rank": 0, "world_size": 1, "prefetch": 2}
    check_resume(f"{storage_root}/part-*.jsonl", "JSONL()", options)


@pytest.mark.slow
def test_resume_strided_reader_with_padding(tmp_path, id_files) -> None:
    id_files(str(tmp_path), [40, 3])
    options = {
        "seed": 9,
        "shuffle_buffer": 8,
        "rank": 2,
        "world_size": 3,
        "equalize": "pad",
        "batch_size": 32,
    }
    check_resume(f"{tmp_path}/part-*.jsonl", "JSONL()", options)  # 15 own records + 17 padding


@pytest.mark.slow
def test_resume_file_level_sharding_other_rank(tmp_path, id_files) -> None:
    id_files(str(tmp_path))
    check_resume(
        f"{tmp_path}/part-*.jsonl", "JSONL()", {"seed": 2, "shuffle_buffer": 5, "rank": 1, "world_size": 2}
    )


@pytest.mark.slow
def test_resume_gzip_tfrecord_and_csv(storage_root: str) -> None:
    uri = paths.join(storage_root, "r.tfrecord.gz")
    with TFRecordWriter(uri) as writer:
        for i in range(300):
            writer.write(f"rec-{i:04d}".encode() * (1 + i % 7))
    check_resume(uri, "TFRecord()", {"seed": 1, "shuffle_buffer": 64, "rank": 0, "world_size": 1})
    csv_uri = paths.join(storage_root, "r.csv")
    with paths.open(csv_uri, "w") as f:
        f.write("id,text\n" + "".join(f'{i},"line {i}\nwith, a quoted newline"\n' for i in range(2500)))
    csv_format = "CSV(types={'id': int})"
    check_resume(csv_uri, csv_format, {"seed": 1, "shuffle_buffer": 10, "rank": 0, "world_size": 1})
    check_resume(csv_uri, csv_format, {"shuffle": False, "rank": 1, "world_size": 3})  # strided, 1 file


def test_state_is_json_and_validated(tmp_path, id_files) -> None:
    id_files(str(tmp_path))
    ds = open_dataset(f"{tmp_path}/part-*.jsonl", seed=1, rank=0, world_size=1)
    it = iter(ds)
    next(it)
    state = json.loads(json.dumps(ds.state_dict()))
    assert state["epoch"] == 0 and list(state["cursors"]) == ["0"]
    other = open_dataset(f"{tmp_path}/part-*.jsonl", seed=2, rank=0, world_size=1)
    from vertexrt.errors import ConfigError, DataError

    with pytest.raises(DataError, match="different data or options"):
        other.load_state_dict(state)
    wider = open_dataset(f"{tmp_path}/part-*.jsonl", seed=1, rank=0, world_size=2)
    wider.load_state_dict(state)
    with pytest.raises(ConfigError, match="saved with 1 readers"):
        next(iter(wider))


def test_end_of_epoch_state_starts_the_next_epoch(tmp_path, id_files) -> None:
    id_files(str(tmp_path), [4, 4])
    ds = open_dataset(f"{tmp_path}/part-*.jsonl", seed=1, rank=0, world_size=1)
    epoch0 = [r["id"] for r in ds]
    state = ds.state_dict()
    assert state["epoch"] == 1 and state["cursors"] == {}
    again = open_dataset(f"{tmp_path}/part-*.jsonl", seed=1, rank=0, world_size=1)
    again.load_state_dict(state)
    again.set_epoch(1)  # the usual loop: set_epoch(epoch) after restoring keeps the position
    epoch1 = [r["id"] for r in again]
    assert sorted(epoch1) == sorted(epoch0) and len(epoch1) == 8

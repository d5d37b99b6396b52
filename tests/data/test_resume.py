"""Exact resume: stop at random points, resume in a fresh process, the concatenation equals the stream."""

from __future__ import annotations

import json
import random
import subprocess
import sys
import threading
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
    from vertexrt.errors import DataError

    with pytest.raises(DataError, match="different data or options") as caught:
        other.load_state_dict(state)
    assert "seed: saved 1, now 2" in str(caught.value)
    wider = open_dataset(f"{tmp_path}/part-*.jsonl", seed=1, rank=0, world_size=2)
    wider.load_state_dict(state)
    with pytest.raises(DataError, match=r"saved with world_size=1 x 1 .* world_size=2 x 1"):
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


def test_a_state_for_other_options_names_what_changed(tmp_path, id_files) -> None:
    from vertexrt.errors import DataError

    id_files(str(tmp_path), [4, 4])
    saved = open_dataset(f"{tmp_path}/part-*.jsonl", batch_size=8, rank=0, world_size=1)
    state = saved.state_dict()
    resumed = open_dataset(f"{tmp_path}/part-*.jsonl", batch_size=16, rank=0, world_size=1)
    with pytest.raises(DataError, match="batch_size: saved 8, now 16") as caught:
        resumed.load_state_dict(state)
    assert "seed" not in str(caught.value) and "start the epoch afresh" in str(caught.value)
    id_files(str(tmp_path), [4, 5])  # a data file grew
    grown = open_dataset(f"{tmp_path}/part-*.jsonl", batch_size=8, rank=0, world_size=1)
    with pytest.raises(DataError, match=r"files: saved 2 files of \d+ bytes, now 2 files of \d+ bytes"):
        grown.load_state_dict(state)


def _lines_with_bad(tmp_path: Any, n: int, bad: dict[int, bytes]) -> tuple[str, list[int]]:
    """A JSONL file of ``{"id": i}`` lines with the lines at ``bad``'s indexes replaced; the good ids."""
    lines = [bad.get(i, json.dumps({"id": i}).encode()) for i in range(n)]
    path = tmp_path / "runs.jsonl"
    path.write_bytes(b"\n".join(lines) + b"\n")
    return str(path), [i for i in range(n) if i not in bad]


@pytest.mark.parametrize("shuffle", [False, True])
def test_state_between_any_two_records_across_decode_runs(tmp_path, shuffle: bool) -> None:
    # records are decoded a run at a time (dataset.DECODE_RUN): stops at, before and after run edges and
    # around bad lines (skipped, or whitespace-only and ignored) resume exactly
    path, good = _lines_with_bad(tmp_path, 700, {100: b"{oops", 255: b"  ", 256: b"[1,", 511: b"}"})
    options: dict[str, Any] = {"shuffle": shuffle, "shuffle_buffer": 300, "on_error": "skip"}
    full = [r["id"] for r in open_dataset(path, rank=0, world_size=1, **options)]
    assert sorted(full) == good
    for stop in (0, 1, 99, 100, 101, 254, 255, 256, 257, 299, 300, 509, 510, 511, 512, len(full)):
        ds = open_dataset(path, rank=0, world_size=1, **options)
        it = iter(ds)
        head = [next(it)["id"] for _ in range(stop)]
        state = json.loads(json.dumps(ds.state_dict()))
        del it
        again = open_dataset(path, rank=0, world_size=1, **options)
        again.load_state_dict(state)
        assert head + [r["id"] for r in again] == full, f"stop={stop}"


def test_a_bad_record_mid_run_hands_out_the_records_before_it_then_resumes_after(tmp_path) -> None:
    from vertexrt.errors import DataError

    path, good = _lines_with_bad(tmp_path, 600, {300: b"{oops"})
    ds = open_dataset(path, shuffle=False, rank=0, world_size=1)
    got = []
    with pytest.raises(DataError, match=r"runs.jsonl:301 \(byte \d+\): malformed JSON"):
        for record in ds:
            got.append(record["id"])
    assert got == good[:300]
    assert [r["id"] for r in ds] == good[300:]  # the same dataset goes on after the bad line
    assert ds.epoch == 1


def test_state_at_the_edge_of_a_local_read(tmp_path) -> None:
    # local files are read LOCAL_READ_SIZE bytes at a time: stops at the records around a read's edge
    # (one of them crossing it) resume exactly
    from vertexrt.data.formats._lines import LOCAL_READ_SIZE

    lines = [json.dumps({"id": i, "pad": "x" * (i % 100)}).encode() for i in range(40_000)]
    path = tmp_path / "edges.jsonl"
    path.write_bytes(b"\n".join(lines) + b"\n")
    assert path.stat().st_size > 2 * LOCAL_READ_SIZE
    ends, total = [], 0
    for index, line in enumerate(lines):
        total += len(line) + 1
        if total > LOCAL_READ_SIZE and not ends or total > 2 * LOCAL_READ_SIZE and len(ends) == 1:
            ends.append(index)
    for stop in sorted({e + d for e in ends for d in (-1, 0, 1)}):
        ds = open_dataset(str(path), shuffle=False, rank=0, world_size=1)
        it = iter(ds)
        head = [next(it)["id"] for _ in range(stop)]
        again = open_dataset(str(path), shuffle=False, rank=0, world_size=1)
        again.load_state_dict(json.loads(json.dumps(ds.state_dict())))
        del it
        assert head + [r["id"] for r in again] == list(range(40_000)), f"stop={stop}"


def test_leaving_the_loop_keeps_the_position(tmp_path) -> None:
    # the iterator dropped mid-run (break) leaves the cursor right after the last record handed out
    path, good = _lines_with_bad(tmp_path, 100, {})
    ds = open_dataset(path, shuffle=False, rank=0, world_size=1)
    head = []
    for record in ds:
        head.append(record["id"])
        if len(head) == 45:
            break
    state = json.loads(json.dumps(ds.state_dict()))
    assert head + [r["id"] for r in ds] == good  # the same dataset goes on from there
    again = open_dataset(path, shuffle=False, rank=0, world_size=1)
    again.load_state_dict(state)
    assert [r["id"] for r in again] == good[45:]


@pytest.mark.parametrize("prefetch", [0, 2])
def test_closing_the_iterator_ends_the_pass_and_keeps_the_position(tmp_path, prefetch: int) -> None:
    # iter(ds) stopped being a generator (a C chain, for speed): close() raised AttributeError, which broke
    # the Keras reader seek that reads N records and closes the stream.
    path, good = _lines_with_bad(tmp_path, 100, {})
    ds = open_dataset(path, shuffle=False, rank=0, world_size=1, prefetch=prefetch)
    it = iter(ds)
    head = [next(it)["id"] for _ in range(45)]
    it.close()
    assert list(it) == []  # like a closed generator
    state = json.loads(json.dumps(ds.state_dict()))
    again = open_dataset(path, shuffle=False, rank=0, world_size=1)
    again.load_state_dict(state)
    assert head + [r["id"] for r in again] == good
    assert not [t for t in threading.enumerate() if "prefetch" in t.name.lower() and t.is_alive()]


# -- a damaged or edited state is refused before use, naming the field ----------------------------------


def saved_at(tmp_path: Any, id_files: Any, stop: int = 100, **options: Any) -> tuple[Any, dict[str, Any]]:
    """``(fresh, state)``: a dataset maker over one JSONL file of 300 records, its state after ``stop``."""
    id_files(str(tmp_path), [300])

    def fresh() -> Any:
        return open_dataset(f"{tmp_path}/part-*.jsonl", shuffle=False, rank=0, world_size=1, **options)

    ds = fresh()
    it = iter(ds)
    for _ in range(stop):
        next(it)
    state = json.loads(json.dumps(ds.state_dict()))
    it.close()
    return fresh, state


def tampered(state: dict[str, Any], where: tuple[str, ...], value: Any) -> dict[str, Any]:
    edited = json.loads(json.dumps(state))
    target = edited
    for key in where[:-1]:
        target = target[key]
    target[where[-1]] = value
    return edited


@pytest.mark.parametrize(
    ("where", "value", "field"),
    [
        (("epoch",), "1", "epoch"),
        (("epoch",), -1, "epoch"),
        (("readers",), 0, "readers"),
        (("readers",), "1", "readers"),
        (("cursors",), [], "cursors"),
        (("cursors", "0"), 5, r"cursors\['0'\]"),
        (("cursors", "0", "pos"), "12", r"cursors\['0'\]\.pos"),
        (("cursors", "0", "skip"), -5, r"cursors\['0'\]\.skip"),
        (("cursors", "0", "emitted"), True, r"cursors\['0'\]\.emitted"),
        (("cursors", "0", "unit"), 1.0, r"cursors\['0'\]\.unit"),
        (("cursors", "0", "phase"), 7, r"cursors\['0'\]\.phase"),
        (("cursors", "0", "emitted"), 2**70, r"cursors\['0'\]\.emitted"),
        (("covers",), ["0"], "covers"),
        (("plan",), "all", "plan"),
        (("plan",), [[5, 2]], r"plan\[0\]"),
        (("plan",), [[0, 5], [3, 9]], r"plan\[1\]"),
        (("plan",), [[0, -1]], r"plan\[0\]\[1\]"),
    ],
)
def test_a_state_field_of_the_wrong_type_or_sign_is_a_data_error_naming_it(
    tmp_path, id_files, where: tuple[str, ...], value: Any, field: str
) -> None:
    from vertexrt.errors import DataError

    fresh, state = saved_at(tmp_path, id_files)
    ds = fresh()
    with pytest.raises(DataError, match=rf"data state field {field}=.*start the epoch afresh"):
        ds.load_state_dict(tampered(state, where, value))
        list(ds)


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("pos", 10**9, r"cursor \(pos, skip\)=.* points past the records of .*part-00.jsonl"),
        ("skip", 10**6, r"cursor \(pos, skip\)=.* points past the records of .*part-00.jsonl"),
        ("unit", 50, r"cursors\['0'\]\.unit=.* is past this reader's 1 units"),
    ],
)
def test_a_cursor_past_the_data_is_refused(tmp_path, id_files, field: str, value: int, message: str) -> None:
    from vertexrt.errors import DataError

    fresh, state = saved_at(tmp_path, id_files)
    ds = fresh()
    ds.load_state_dict(tampered(state, ("cursors", "0", field), value))
    with pytest.raises(DataError, match=message):
        list(ds)  # before: the 200 records left were never delivered, and no error


@pytest.mark.timeout(60)
def test_a_tampered_elastic_plan_or_record_count_is_refused(tmp_path, id_files) -> None:
    from vertexrt.errors import DataError

    fresh, state = saved_at(tmp_path, id_files, equalize="drop_remainder")
    ds = fresh()
    ds.load_state_dict(tampered(state, ("plan",), [[0, 10**7]]))  # before: padded with repeats for minutes
    with pytest.raises(DataError, match=r"data state field plan=.* reaches past the epoch's 300 records"):
        list(ds)
    ds = fresh()
    ds.load_state_dict(tampered(state, ("cursors", "0", "emitted"), 10**6))
    with pytest.raises(DataError, match=r"cursors\['0'\]\.emitted=.* is past this reader's 300 records"):
        list(ds)
    ds = fresh()
    ds.load_state_dict(state)  # untouched, it resumes exactly
    assert [r["id"] for r in ds] == list(range(100, 300))


# -- a file rewritten at the same size is not the file the state was saved for --------------------------


def test_a_file_rewritten_at_the_same_size_is_detected(storage_root: str, write_jsonl) -> None:
    import os

    from vertexrt.errors import DataError

    uri = paths.join(storage_root, "part.jsonl")
    records = [{"id": i} for i in range(100, 400)]  # three-digit ids: any order has the same size
    write_jsonl(uri, records)
    ds = open_dataset(uri, shuffle=False, rank=0, world_size=1)
    it = iter(ds)
    for _ in range(150):
        next(it)
    state = json.loads(json.dumps(ds.state_dict()))
    it.close()
    before = paths.filesystem(uri)[0].info(paths.filesystem(uri)[1])
    write_jsonl(uri, records[::-1])  # the same records in a new order: the same size
    if paths.storage_kind(uri) == "local":  # a rewrite moves the modification time on (here by 1 s)
        os.utime(uri, ns=(os.stat(uri).st_atime_ns, os.stat(uri).st_mtime_ns + 10**9))
    rewritten = open_dataset(uri, shuffle=False, rank=0, world_size=1)
    assert paths.filesystem(uri)[0].info(paths.filesystem(uri)[1])["size"] == before["size"]
    with pytest.raises(DataError, match="a file was rewritten since the state was saved") as caught:
        rewritten.load_state_dict(state)  # before: 150 duplicates and 150 records never seen
    assert "start the epoch afresh" in str(caught.value)


def test_data_rewritten_identically_on_cloud_storage_still_resumes(storage_root: str, write_jsonl) -> None:
    """A job that writes its data again at each start (the same bytes: a new generation, the same CRC32C)
    resumes its reader; only other content is refused (above)."""
    if paths.storage_kind(storage_root) == "local":
        pytest.skip("on local disk the modification time is the version")
    uri = paths.join(storage_root, "same.jsonl")
    records = [{"id": i} for i in range(100, 400)]
    write_jsonl(uri, records)
    ds = open_dataset(uri, shuffle=False, rank=0, world_size=1)
    it = iter(ds)
    seen = [next(it)["id"] for _ in range(150)]
    state = json.loads(json.dumps(ds.state_dict()))
    it.close()
    write_jsonl(uri, records)  # the same bytes again: a new generation
    again = open_dataset(uri, shuffle=False, rank=0, world_size=1)
    again.load_state_dict(state)
    assert seen + [r["id"] for r in again] == [r["id"] for r in records]


def test_merging_a_damaged_state_names_the_field(tmp_path, id_files) -> None:
    from vertexrt.data import merge_states
    from vertexrt.errors import DataError

    _, state = saved_at(tmp_path, id_files)
    with pytest.raises(DataError, match=r"data state field epoch='x'"):
        merge_states([state, tampered(state, ("epoch",), "x")])  # before: a raw ValueError
    with pytest.raises(DataError, match=r"data state field cursors\['0'\]\.pos"):
        merge_states([tampered(state, ("cursors", "0", "pos"), [1])])
    with pytest.raises(DataError, match="not a vertexrt data state"):
        merge_states([state, None])  # type: ignore[list-item]
    assert merge_states([state])["cursors"] == state["cursors"]

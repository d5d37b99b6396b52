"""vertexrt.audit: off by default; on, one JSON line per event, and a fault plan lands where it says."""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path
from typing import Any

import pytest
from jobs import run_job

from vertexrt import audit
from vertexrt.errors import DataError


@pytest.fixture
def audited(tmp_path: Path, monkeypatch):
    def start(plan: dict | None = None) -> Path:
        monkeypatch.setenv(audit.DIRECTORY_VARIABLE, str(tmp_path))
        monkeypatch.setenv(audit.REPLICA_VARIABLE, "workerpool0-0")
        monkeypatch.setenv(audit.PLAN_VARIABLE, json.dumps(plan or {}))
        audit.reset()
        return tmp_path / "workerpool0-0.jsonl"

    yield start
    audit.reset()


def _events(path: Path) -> list[tuple[str, int | None]]:
    return [(e["event"], e.get("step")) for e in map(json.loads, path.read_text().splitlines())]


def test_off_without_the_variable_writes_nothing(tmp_path, monkeypatch) -> None:
    monkeypatch.delenv(audit.DIRECTORY_VARIABLE, raising=False)
    monkeypatch.chdir(tmp_path)
    audit.reset()
    audit.step(1)
    audit.event("commit", step=1)
    assert list(tmp_path.iterdir()) == []


def test_steps_are_counted_once_and_a_position_report_is_not_a_step(audited) -> None:
    path = audited()
    audit.step(0)  # the watchdog's first beat reports the position, nothing done yet
    audit.event("resume", step=4)
    audit.step(4)  # the restored step again
    audit.step(5)
    audit.step(5)
    audit.event("commit", step=5)
    assert _events(path) == [("resume", 4), ("step", 5), ("commit", 5)]


@pytest.mark.parametrize(
    ("fault", "landed"),
    [
        ({"on": "step", "at": 3}, ("fault", 3)),
        ({"on": "first_step"}, ("fault", 1)),
        ({"on": "save", "at": 2, "asynchronous": True}, ("fault", 2)),
    ],
)
def test_a_fault_lands_inside_its_event(audited, fault, landed) -> None:
    received = []
    previous = signal.signal(signal.SIGUSR1, lambda *_: received.append(True))
    try:
        path = audited({"fault": {**fault, "signal": "SIGUSR1"}})
        for step in (1, 2, 3, 4):
            audit.step(step)
            audit.event("save", step=step, asynchronous=step % 2 == 0)
    finally:
        signal.signal(signal.SIGUSR1, previous)
    assert received == [True]  # once
    events = _events(path)
    faults = [i for i, e in enumerate(events) if e[0] == "fault"]
    assert [events[i] for i in faults] == [landed]


def _jsonl(tmp_path: Path, records: int = 50) -> Path:
    path = tmp_path / "data" / "part.jsonl"
    path.parent.mkdir()
    path.write_text("".join(json.dumps({"id": i}) + "\n" for i in range(records)))
    return path


def _checkpointed(dataset: Any) -> Any:
    dataset.state_dict()  # a reader whose state is saved (put in a checkpoint) is audited
    return dataset


def _epochs(path: Path) -> dict[int, tuple[int, str]]:
    found = [e for e in map(json.loads, path.read_text().splitlines()) if e["event"] == "data_epoch"]
    return {e["epoch"]: (e["count"], e["digest"]) for e in found}


@pytest.mark.parametrize("options", [{"shuffle": False}, {"shuffle": True, "shuffle_buffer": 16, "seed": 3}])
def test_the_data_digest_continues_across_a_saved_and_restored_reader(audited, tmp_path, options) -> None:
    from vertexrt.data import open_dataset

    data = _jsonl(tmp_path)
    log = audited()
    whole = _checkpointed(open_dataset(str(data), **options))
    assert len(list(whole)) == 50
    (reference,) = _epochs(log).values()
    assert reference[0] == 50
    log.unlink()
    audit.reset()
    audited()
    first = open_dataset(str(data), **options)
    it = iter(first)
    head = [next(it) for _ in range(23)]
    state = first.state_dict()
    assert next(iter(state["cursors"].values()))["audit"]["count"] == 23
    resumed = open_dataset(str(data), **options)
    resumed.load_state_dict(json.loads(json.dumps(state)))
    tail = list(resumed)
    assert sorted(r["id"] for r in head + tail) == list(range(50))
    assert _epochs(log) == {0: reference}  # the resumed reader's epoch: the same records, once each


def test_a_reader_that_starts_over_instead_of_resuming_is_told_apart(audited, tmp_path) -> None:
    from vertexrt.data import open_dataset

    data = _jsonl(tmp_path)
    log = audited()
    validation = open_dataset(str(data), shuffle=False)  # never checkpointed: not audited
    list(validation)
    assert not log.exists() or _epochs(log) == {}
    reference = _checkpointed(open_dataset(str(data), shuffle=False))
    list(reference)
    full = _epochs(log)[0]
    log.unlink()
    audit.reset()
    audited()
    restarted = _checkpointed(open_dataset(str(data), shuffle=False))  # a saved state left unloaded
    it = iter(restarted)
    [next(it) for _ in range(30)]  # the rest of the epoch's worth of steps: records 0..29 again
    restarted.set_epoch(1)
    assert _epochs(log)[0][0] == 30 and _epochs(log)[0] != full


def test_the_data_state_is_unchanged_without_the_audit(tmp_path, monkeypatch) -> None:
    from vertexrt.data import open_dataset

    monkeypatch.delenv(audit.DIRECTORY_VARIABLE, raising=False)
    audit.reset()
    data = _jsonl(tmp_path)
    ds = open_dataset(str(data), shuffle=False)
    it = iter(ds)
    next(it)
    state = ds.state_dict()
    assert "audit" not in state["cursors"]["0"]
    audited_state = json.loads(json.dumps(state))
    audited_state["cursors"]["0"]["audit"] = {"count": 1, "digest": "00000000000000ff"}
    other = open_dataset(str(data), shuffle=False)
    other.load_state_dict(audited_state)  # a state saved under the audit loads without it
    assert [r["id"] for r in other] == list(range(1, 50))
    audited_state["cursors"]["0"]["audit"] = {"count": -1, "digest": "x"}
    monkeypatch.setenv(audit.DIRECTORY_VARIABLE, str(tmp_path / "audit"))
    audit.reset()
    with pytest.raises(DataError, match=r"cursors\['0'\]\.audit"):
        open_dataset(str(data), shuffle=False).load_state_dict(audited_state)
    audit.reset()


def test_the_data_digest_of_dataloader_workers_continues_across_a_resume(tmp_path, monkeypatch) -> None:
    pytest.importorskip("torch")
    from vertexrt.data import open_dataset
    from vertexrt.data.torch import DataLoader
    from vertexrt.distributed.chaos.driver import data_epochs

    data = _jsonl(tmp_path, 256)
    monkeypatch.setenv(audit.REPLICA_VARIABLE, "workerpool0-0")

    def loader(attempt: str) -> DataLoader:
        monkeypatch.setenv(audit.DIRECTORY_VARIABLE, str(tmp_path / attempt / "attempt-1"))
        audit.reset()
        ds = open_dataset(str(data), shuffle=True, shuffle_buffer=8, seed=1, rank=0, world_size=1)
        return DataLoader(ds, batch_size=4, num_workers=2)

    try:
        assert sum(len(b["id"]) for b in loader("reference")) == 256
        first = loader("run")
        batches = iter(first)
        head = [next(batches)["id"] for _ in range(5)]
        state = json.loads(json.dumps(first.state_dict()))
        del batches  # the workers stop, read ahead of the state
        monkeypatch.setenv(audit.DIRECTORY_VARIABLE, str(tmp_path / "run" / "attempt-2"))
        audit.reset()
        second = DataLoader(
            open_dataset(str(data), shuffle=True, shuffle_buffer=8, seed=1, rank=0, world_size=1),
            batch_size=4,
            num_workers=2,
        )
        second.load_state_dict(state)
        tail = [b["id"] for b in second]
    finally:
        audit.reset()
    delivered = sorted(int(i) for batch in head + tail for i in batch)
    assert delivered == list(range(256))
    reference, run = data_epochs(tmp_path / "reference", 1), data_epochs(tmp_path / "run", 2)
    assert sorted(key[1:] for key in reference) == [(0, 0), (0, 1)]
    tallies = {key: (e["count"], e["digest"]) for key, e in run.items()}
    assert tallies == {key: (e["count"], e["digest"]) for key, e in reference.items()}


def test_the_data_digest_of_column_batches_continues_across_a_resume(audited, tmp_path) -> None:
    from vertexrt.data import open_dataset

    data = _jsonl(tmp_path)
    log = audited()
    options = {"shuffle": True, "shuffle_buffer": 16, "seed": 3, "columnar": True, "batch_size": 8}
    assert sum(len(b["id"]) for b in _checkpointed(open_dataset(str(data), **options))) == 50
    reference = _epochs(log)
    log.unlink()
    audit.reset()
    audited()
    first = open_dataset(str(data), **options)
    it = iter(first)
    head = [next(it)["id"] for _ in range(3)]
    resumed = open_dataset(str(data), **options)
    resumed.load_state_dict(json.loads(json.dumps(first.state_dict())))
    tail = [b["id"] for b in resumed]
    assert sorted(int(i) for b in head + tail for i in b) == list(range(50))
    assert reference[0][0] == 50 and _epochs(log) == reference


def test_records_read_through_as_tf_are_audited_once_up_to_the_process_exit(tmp_path) -> None:
    pytest.importorskip("tensorflow")
    data = _jsonl(tmp_path)
    script = (
        "import sys; from vertexrt.data import open_dataset\n"
        "ds = open_dataset(sys.argv[1], shuffle=True, seed=3); ds.state_dict()\n"
        "print(sorted(int(r['id']) for r in ds.as_tf().as_numpy_iterator()) == list(range(50)))\n"
        "it = iter(ds); [next(it) for _ in range(7)]\n"  # epoch 1, left unfinished at the exit
    )
    env = {**os.environ, audit.DIRECTORY_VARIABLE: str(tmp_path / "audit"), audit.REPLICA_VARIABLE: "w"}
    done = run_job([sys.executable, "-c", script, str(data)], None, 120, env, merge_stderr=False)
    assert done.stdout.strip() == "True", done.stderr[-3000:]
    found = [e for e in map(json.loads, (tmp_path / "audit" / "w.jsonl").read_text().splitlines())]
    # as_tf's signature probe (a copy that read one record) reports nothing
    assert [(e["epoch"], e["count"], e["finished"]) for e in found] == [(0, 50, True), (1, 7, False)]

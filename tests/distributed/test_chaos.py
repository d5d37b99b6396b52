"""``local-run --chaos``: the seeded schedule, the comparison of outputs, and the certificate end to end on
a script that resumes exactly and on one that forgets its optimizer state."""

from __future__ import annotations

import io
import json
import re
import sys
from pathlib import Path

import pytest

from vertexrt.distributed.chaos import outputs, schedule
from vertexrt.distributed.chaos.driver import AuditedFaults
from vertexrt.distributed.launcher import JobSpec, Supervisor

WORKERS = ["workerpool0-0", "workerpool1-0", "workerpool1-1"]


def test_the_same_seed_draws_the_same_schedule() -> None:
    assert schedule.draw(1, 5) == schedule.draw(1, 5)
    assert any(schedule.draw(seed, 5) != schedule.draw(1, 5) for seed in (2, 3, 4))


def test_any_twelve_consecutive_runs_cover_every_edge_case() -> None:
    assert len(schedule.KINDS) == 12  # the count the README and `make certify` promise
    assert "vm_lost_disk" in schedule.KINDS
    for seed in (1, 7):
        kinds = [d.kind for d in schedule.draw(seed, 3 * len(schedule.KINDS))]
        for start in range(len(kinds) - len(schedule.KINDS) + 1):
            assert set(kinds[start : start + len(schedule.KINDS)]) == set(schedule.KINDS)


def _placed(kind: str, profile: schedule.Profile, positions=(0.5, 0.5)) -> schedule.Placed:
    run = schedule.Draw(kind, positions, 0.9)
    return schedule.place(run, profile, grace=15, short_grace=3, workers=WORKERS)


PROFILE = schedule.Profile(steps=30, epoch_ends=(10, 20, 30), evals=3, saves=((10, False), (20, True)))


def test_faults_are_placed_where_the_reference_gives_the_chance() -> None:
    assert _placed("epoch_end", PROFILE).faults[1].plan["fault"] == {
        "on": "step",
        "at": 20,
        "signal": "SIGTERM",
    }
    assert _placed("eval", PROFILE).faults[1].plan["fault"]["on"] == "eval"
    assert _placed("save_async", PROFILE).faults[1].plan["fault"]["at"] == 20
    assert _placed("save", PROFILE).faults[1].plan["fault"]["at"] == 10
    lost = _placed("vm_lost", PROFILE).faults[1]
    assert (lost.signal, lost.grace, lost.everyone, lost.replica) == ("SIGKILL", 0.0, False, "workerpool1-1")
    assert not lost.wipe
    with_disk = _placed("vm_lost_disk", PROFILE).faults[1]
    assert (with_disk.signal, with_disk.grace, with_disk.everyone) == ("SIGKILL", 0.0, False)
    assert with_disk.replica == "workerpool1-1" and with_disk.wipe
    one = _placed("one_replica", PROFILE).faults[1]
    assert (one.replica, one.everyone) == ("workerpool1-1", False)
    assert _placed("short_grace", PROFILE).faults[1].grace == 3
    twice = _placed("twice", PROFILE)
    assert twice.faults[1].plan["fault"]["at"] < twice.faults[2].plan["fault"]["at"] < 30
    assert _placed("after_resume", PROFILE).faults[2].plan["fault"] == {
        "on": "first_step",
        "signal": "SIGTERM",
    }
    slow = _placed("slow_steps", PROFILE)
    assert slow.slow is not None and slow.faults[1].plan["fault"]["at"] >= slow.slow["from"]


def test_a_kind_the_script_gives_no_chance_for_becomes_a_step_and_says_so() -> None:
    bare = schedule.Profile(steps=8)
    for kind in ("epoch_end", "eval", "save", "save_async"):
        placed = _placed(kind, bare)
        assert placed.faults[1].plan["fault"]["on"] == "step"
        assert placed.note
    assert all(1 <= _placed("step", bare, (f, f)).faults[1].plan["fault"]["at"] <= 7 for f in (0.0, 0.99))


def test_model_files_compare_by_bytes_or_within_rtol(tmp_path: Path) -> None:
    ref, run = tmp_path / "ref", tmp_path / "run"
    for d, w in ((ref, 1.0), (run, 1.0 + 1e-9)):
        (d / "sub").mkdir(parents=True)
        (d / "sub" / "model.json").write_text(json.dumps({"w": [w, 2.0], "name": "m"}))
        (d / "same.txt").write_text("x")
    (run / "extra.txt").write_text("y")
    exact = outputs.compare_files(ref, run, rtol=None)
    assert (exact.differ, exact.extra, exact.missing) == (["sub/model.json"], ["extra.txt"], [])
    loose = outputs.compare_files(ref, run, rtol=1e-6)
    assert (loose.differ, loose.within_rtol) == ([], ["sub/model.json"])
    (run / "sub" / "model.json").write_text(json.dumps({"w": [1.0, 2.0], "name": "other"}))
    assert outputs.compare_files(ref, run, rtol=1e-6).differ == ["sub/model.json"]


def test_a_saved_model_is_compared_by_its_variables_not_its_function_ids(tmp_path: Path) -> None:
    """Saved twice, the same weights make different SavedModel bytes (TensorFlow numbers each traced function
    per process, as a resumed run traces more): equal variables match; one changed weight does not."""
    tf = pytest.importorskip("tensorflow")
    module = tf.Module()
    module.w = tf.Variable([1.0, 2.0])
    module.call = tf.function(lambda x: x * module.w, input_signature=[tf.TensorSpec([2])])
    for name in ("ref", "run"):
        tf.saved_model.save(module, str(tmp_path / name / "model"))
    files = outputs.compare_files(tmp_path / "ref", tmp_path / "run", rtol=None)
    assert not files and "model/saved_model.pb" in files.by_variables, files
    module.w.assign([1.0, 2.5])
    tf.saved_model.save(module, str(tmp_path / "changed" / "model"))
    files = outputs.compare_files(tmp_path / "ref", tmp_path / "changed", rtol=None)
    assert "model/variables/variables.data-00000-of-00001" in files.differ and not files.by_variables


@pytest.mark.slow
def test_a_script_that_resumes_exactly_is_certified(local_run, tmp_path: Path) -> None:
    report = tmp_path / "chaos.json"
    run = local_run(
        "--chaos",
        "3",
        "--seed",
        "1",
        "--chaos-report",
        str(report),
        "--",
        "chaos_train.py",
        timeout=240,
    )
    assert run.returncode == 0, run.output
    assert "chaos seed 1: all 3 faulted runs match the reference" in run.output
    document = json.loads(report.read_text())
    faulted = document["results"][1:]
    assert [r["kind"] for r in faulted] == [d.kind for d in schedule.draw(1, 3)]
    assert all(r["landed"] and r["resumed_from"] and r["steps"] == 12 for r in faulted)


@pytest.mark.slow
def test_a_script_that_forgets_its_optimizer_state_is_named(local_run, tmp_path: Path) -> None:
    # seed 5 draws three SIGTERMs with a full grace: each run resumes from the save made at the notice.
    # (A lost VM resumes from the last periodic save, which may be none: the forgetful script then starts
    # over, and matches.)
    assert {d.kind for d in schedule.draw(5, 3)} == {"one_replica", "eval", "slow_steps"}
    run = local_run("--chaos", "3", "--seed", "5", "--", "chaos_train.py", "--forget-momentum", timeout=240)
    assert run.returncode == 1, run.output
    assert "model files differ: model.json" in run.output
    assert "the optimizer state, the RNG or the data position was not restored?" in run.output
    assert "chaos seed 5: 3 of 3 faulted runs differ from the reference" in run.output


def test_chaos_refuses_options_that_place_their_own_faults_or_remote_outputs(capsys) -> None:
    from vertexrt.distributed.launcher import main

    assert main(["--chaos", "2", "--preempt-after", "5", "--", "python", "-c", "pass"]) == 2
    assert "--chaos places its own faults" in capsys.readouterr().err
    assert main(["--chaos", "2", "--base-output-dir", "gs://b/run", "--", "python", "-c", "pass"]) == 2
    assert "give a local directory" in capsys.readouterr().err


def test_a_reference_that_reports_no_steps_gives_no_certificate(local_run, tmp_path: Path) -> None:
    run = local_run("--chaos", "2", "--", "python", "-c", "print('no steps here')", timeout=60)
    assert run.returncode == 1, run.output
    assert "reported 0 step(s) to vertexrt's step hooks" in run.output
    assert "no certificate" in run.output


def _records(tmp_path: Path) -> Path:
    path = tmp_path / "records.jsonl"
    path.write_text("".join(json.dumps({"id": i}) + "\n" for i in range(32)))
    return path


@pytest.mark.slow
def test_a_script_reading_a_vertexrt_dataset_is_certified_with_its_data_audit(local_run, tmp_path) -> None:
    report = tmp_path / "chaos.json"
    data = str(_records(tmp_path))
    run = local_run(
        "--chaos",
        "3",
        "--seed",
        "1",
        "--chaos-report",
        str(report),
        "--",
        "chaos_data.py",
        "--data",
        data,
        timeout=240,
    )
    assert run.returncode == 0, run.output
    document = json.loads(report.read_text())
    assert document["results"][0]["data_audit"] == "2 epoch digests recorded"
    faulted = document["results"][1:]
    assert [r["data_audit"] for r in faulted] == ["2 of 2 epoch data digests match the reference"] * 3


@pytest.mark.slow
def test_a_script_that_reads_its_data_again_after_a_resume_is_named(local_run, tmp_path) -> None:
    report = tmp_path / "chaos.json"
    data = str(_records(tmp_path))
    run = local_run(
        "--chaos",
        "2",
        "--seed",
        "1",
        "--chaos-report",
        str(report),
        "--",
        "chaos_data.py",
        "--data",
        data,
        "--forget-data",
        timeout=240,
    )
    assert run.returncode == 1, run.output
    faulted = json.loads(report.read_text())["results"][1:]
    for result in faulted:  # the model and the steps match: only the data audit tells
        assert not any(
            d.startswith(("model files", "exit code")) or "steps" in d for d in result["differences"]
        )
        assert any(
            re.fullmatch(r"records of epoch \d \(reader 0\) never delivered \(count \d+ vs 32\)", d)
            for d in result["differences"]
        ), result
    assert "was the data reader's state (state_dict) saved with the checkpoint and restored" in run.output


def test_data_epochs_that_differ_are_named_per_reader_or_summed_over_readers() -> None:
    from vertexrt.distributed.chaos.driver import Outcome, compare_data

    def tallies(readers: int, *rows: tuple[int, int, int, str]) -> dict:
        return {
            ("d", epoch, reader): {
                "data": "d",
                "source": "a.jsonl",
                "readers": readers,
                "count": n,
                "digest": h,
            }
            for epoch, reader, n, h in rows
        }

    ref = tallies(2, (0, 0, 8, "0" * 15 + "1"), (0, 1, 8, "0" * 15 + "2"), (1, 0, 8, "0" * 15 + "3"))
    same = Outcome("run-1")
    compare_data(same, ref, dict(ref))
    assert (same.differences, same.data_audit) == ([], "3 of 3 epoch data digests match the reference")
    wrong = Outcome("run-2")
    run = tallies(2, (0, 0, 9, "0" * 15 + "1"), (0, 1, 8, "0" * 15 + "7"), (1, 0, 5, "0" * 15 + "3"))
    compare_data(wrong, ref, run)
    assert wrong.differences == [
        "records of epoch 0 (reader 0) delivered more than once (count 9 vs 8)",
        "records of epoch 0 (reader 1) delivered more than once and others never delivered (count 8 vs 8)",
        "records of epoch 1 (reader 0) never delivered (count 5 vs 8)",
    ]
    other_readers = Outcome("run-3")  # the same records, read by 1 reader instead of 2: summed per epoch
    run = tallies(1, (0, 0, 16, "0" * 15 + "3"), (1, 0, 8, "0" * 15 + "3"))
    compare_data(other_readers, ref, run)
    assert other_readers.differences == []
    assert other_readers.data_audit.endswith("(summed over readers: the readers differ)")


def test_a_vm_lost_with_its_disk_under_chaos_restarts_that_replica_on_an_empty_disk(tmp_path: Path) -> None:
    fault = schedule.Fault(
        {"fault": {"on": "step", "at": 3, "signal": "SIGKILL"}},
        "workerpool1-0",
        everyone=False,
        grace=0.0,
        signal="SIGKILL",
        wipe=True,
    )
    placed = schedule.Placed("vm_lost_disk", faults={1: fault})
    script = Path(__file__).parent / "scripts" / "local_disk.py"
    job = JobSpec(command=[sys.executable, str(script)], workers=3, base_output_dir=str(tmp_path / "out"))
    out = io.BytesIO()
    faults = AuditedFaults(tmp_path / "audit", placed, tmp_path / "hp" / "output.metrics")
    supervisor = Supervisor(job, grace=3, restarts=1, faults=faults, out=out)
    assert supervisor.run() == 0, out.getvalue().decode()
    assert [a.outcome for a in supervisor.attempts] == ["preempted", "succeeded"]
    assert supervisor.attempts[0].codes["workerpool1-0"] == 137
    reports = {}
    for line in out.getvalue().decode().splitlines():
        label, _, rest = line.partition("] RESULT ")
        if rest:
            reports[label.lstrip("[")] = json.loads(rest)  # the last: the second attempt's
    assert reports["workerpool1-0"] == {**reports["workerpool1-0"], "attempt": 2, "files": []}
    assert reports["workerpool0-0"]["files"] == reports["workerpool1-1"]["files"] == ["attempt-1"]

"""``local-run --chaos``: the seeded schedule, the comparison of outputs, and the certificate end to end on
a script that resumes exactly and on one that forgets its optimizer state."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from vertexrt.distributed.chaos import outputs, schedule

WORKERS = ["workerpool0-0", "workerpool1-0", "workerpool1-1"]


def test_the_same_seed_draws_the_same_schedule() -> None:
    assert schedule.draw(1, 5) == schedule.draw(1, 5)
    assert any(schedule.draw(seed, 5) != schedule.draw(1, 5) for seed in (2, 3, 4))


def test_consecutive_runs_cover_every_edge_case() -> None:
    kinds = [d.kind for d in schedule.draw(7, len(schedule.KINDS))]
    assert sorted(kinds) == sorted(schedule.KINDS)


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
    run = local_run("--chaos", "3", "--seed", "1", "--", "chaos_train.py", "--forget-momentum", timeout=240)
    assert run.returncode == 1, run.output
    assert "model files differ: model.json" in run.output
    assert "the optimizer state, the RNG or the data position was not restored?" in run.output
    assert "chaos seed 1: 3 of 3 faulted runs differ from the reference" in run.output


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

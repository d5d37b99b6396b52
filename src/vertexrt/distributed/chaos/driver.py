"""``local-run --chaos N --seed S``: a seeded fault certificate for a training script.

One reference run without faults, then N runs under the faults :mod:`.schedule` draws from the seed, each
faulted attempt restarted as Vertex would (the whole job). Each process writes what it did through
:mod:`vertexrt.audit` (steps, epoch ends, evaluations, saves, commits, restores), and the fault lands where
the schedule placed it: the replica signals itself from inside that event, the launcher reads the
``fault`` line and preempts the other replicas as Vertex would (all of them, or none with ``one_replica``).

A faulted run matches when its exit code, every file under ``AIP_MODEL_DIR`` (byte for byte, or within
``--chaos-rtol`` where a file parses), its last hypertune report and its count of optimizer steps equal
the reference's, and so does the data audit where vertexrt readers are used: per epoch and reader, the
count and digest of the records delivered (:mod:`vertexrt.data.digest`). The report has one row per run
(fault, where it landed, resumed from, steps repeated or lost, what differed, the preemption latency:
seconds and steps from the notice to the committed save), a summary line, hints where a difference says
what was forgotten, and ``--chaos-report FILE`` as JSON.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vertexrt import audit
from vertexrt.distributed.chaos import outputs, schedule
from vertexrt.distributed.local_run.environments import JobSpec, Replica, port_count, replica_environments
from vertexrt.distributed.local_run.supervisor import FaultNotice, Supervisor
from vertexrt.errors import ConfigError


@dataclass
class Options:
    """What ``--chaos`` was asked for."""

    runs: int
    seed: int
    grace: float
    rtol: float | None = None
    report: str | None = None


class AuditedFaults:
    """The launcher's :class:`FaultSource` for one run: audit variables per replica and attempt, each
    attempt's planned fault, and the notice once its ``fault`` line is written."""

    def __init__(self, directory: Path, placed: schedule.Placed | None, metric_file: Path) -> None:
        self.directory = directory
        self.placed = placed
        self.metric_file = metric_file
        self._noticed: set[int] = set()
        self._offsets: dict[Path, int] = {}

    def environment(self, attempt: int, replica: Replica) -> dict[str, str]:
        plan: dict[str, Any] = {}
        if self.placed is not None:
            if self.placed.slow is not None:
                plan["slow"] = self.placed.slow
            fault = self.placed.faults.get(attempt)
            if fault is not None and fault.replica == replica.label:
                plan.update(fault.plan)
        return {
            "CLOUD_ML_HP_METRIC_FILE": str(self.metric_file),  # this run's, even when the shell sets one
            audit.DIRECTORY_VARIABLE: str(self.directory / f"attempt-{attempt}"),
            audit.REPLICA_VARIABLE: replica.label,
            audit.PLAN_VARIABLE: json.dumps(plan),
        }

    def notice(self, attempt: int) -> FaultNotice | None:
        fault = self.placed.faults.get(attempt) if self.placed is not None else None
        if fault is None or attempt in self._noticed:
            return None
        path = self.directory / f"attempt-{attempt}" / (fault.replica.replace("/", "_") + ".jsonl")
        try:
            with path.open("rb") as f:
                f.seek(self._offsets.get(path, 0))
                chunk = f.read()
        except OSError:
            return None
        complete = chunk[: chunk.rfind(b"\n") + 1]
        self._offsets[path] = self._offsets.get(path, 0) + len(complete)
        if b'"event": "fault"' not in complete:
            return None
        self._noticed.add(attempt)
        return FaultNotice(fault.replica, fault.everyone, fault.grace, wipe=fault.wipe)


def events(directory: Path, replica: str) -> list[dict[str, Any]]:
    """The audit events ``replica`` wrote under ``directory`` (an attempt's), in order."""
    path = directory / (replica.replace("/", "_") + ".jsonl")
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return []
    found = []
    for line in lines:
        try:
            found.append(json.loads(line))
        except ValueError:  # a line cut by a SIGKILL
            continue
    return found


def data_epochs(directory: Path, attempts: int) -> dict[tuple[str, int, int], dict[str, Any]]:
    """The data audit of a run: per ``(dataset, epoch, reader)``, the last ``data_epoch`` tally of any
    replica in ``attempts`` attempts; a tally read by the reporting process wins over one it only loaded
    from a state and left (a DataLoader's main process, whose workers read)."""
    chosen: dict[tuple[str, int, int], dict[str, Any]] = {}
    for number in range(1, attempts + 1):
        attempt_dir = directory / f"attempt-{number}"
        for path in sorted(attempt_dir.glob("*.jsonl")):
            for e in events(attempt_dir, path.stem):
                if e["event"] != "data_epoch":
                    continue
                key = (str(e.get("data")), int(e["epoch"]), int(e["reader"]))
                if e.get("read", True) or not chosen.get(key, {}).get("read", False):
                    chosen[key] = e
    return chosen


def profile(directory: Path, chief: str) -> schedule.Profile:
    """What the reference showed on its chief (its first and only attempt)."""
    seen = events(directory / "attempt-1", chief)
    steps = [e["step"] for e in seen if e["event"] == "step"]
    return schedule.Profile(
        steps=max(steps, default=0),
        epoch_ends=tuple(e["step"] for e in seen if e["event"] == "epoch_end"),
        evals=sum(e["event"] == "eval" for e in seen),
        saves=tuple((e["step"], bool(e.get("asynchronous"))) for e in seen if e["event"] == "save"),
    )


@dataclass
class Outcome:
    """One run of the job (the reference or a faulted one), compared."""

    name: str
    kind: str = "reference"
    fault: str = ""
    code: int = 0
    steps: int = 0
    landed: list[str] = field(default_factory=list)
    resumed_from: list[int | None] = field(default_factory=list)
    repeated: int = 0
    lost: int = 0
    latency: list[str] = field(default_factory=list)
    differences: list[str] = field(default_factory=list)
    hints: list[str] = field(default_factory=list)
    within_rtol: list[str] = field(default_factory=list)
    by_variables: list[str] = field(default_factory=list)
    note: str = ""
    data_audit: str = ""

    @property
    def matches(self) -> bool:
        return not self.differences


def certify(job: JobSpec, options: Options, out: Any = None) -> int:
    """Run the reference and ``options.runs`` faulted runs of ``job``; print the report; 0 when all match."""
    if job.base_output_dir and "://" in job.base_output_dir:
        raise ConfigError(
            f"local-run --chaos: --base-output-dir {job.base_output_dir} is not local: the certificate "
            "compares files byte for byte on this machine; give a local directory"
        )
    root = Path(job.base_output_dir or os.path.join("vertexrt_output", job.job_id)).absolute() / "chaos"
    labels = [r.label for r in replica_environments(job, {}, list(range(port_count(job)))) if r.runs]
    training = [label for label in labels if label.startswith(("workerpool0", "workerpool1"))]
    chief = training[0]
    _say(f"reference run (no faults) in {root / 'reference'}")
    reference = _run(job, root / "reference", None, options.grace)
    if reference.attempts[-1].outcome == "interrupted":
        _say("interrupted: no certificate")
        return reference.attempts[-1].code
    ref = _outcome("reference", reference, root / "reference", chief, None, schedule.Profile(0))
    ref_data = data_epochs(root / "reference" / "audit", 1)
    if ref_data:
        ref.data_audit = f"{len(ref_data)} epoch digests recorded"
    ref_profile = profile(root / "reference" / "audit", chief)
    ref.steps = ref_profile.steps
    if reference.attempts[-1].outcome != "succeeded":
        ref.differences.append(f"the reference run failed with exit code {ref.code}: nothing to compare")
    if ref_profile.steps < 2:
        ref.differences.append(
            f"the reference run reported {ref_profile.steps} step(s) to vertexrt's step hooks: a fault needs "
            "2 or more (use vertexrt's Trainer, ctx.step(step) or a vertexrt callback)"
        )
    results = [ref]
    if ref.matches:
        short = max(1.0, options.grace / 5)
        for i, drawn in enumerate(schedule.draw(options.seed, options.runs), 1):
            placed = schedule.place(
                drawn, ref_profile, grace=options.grace, short_grace=short, workers=training
            )
            name = f"run-{i}"
            _say(f"{name}: {placed.describe()}")
            supervisor = _run(job, root / name, placed, options.grace)
            if supervisor.attempts[-1].outcome == "interrupted":
                _say("interrupted: no certificate")
                return supervisor.attempts[-1].code
            result = _outcome(name, supervisor, root / name, chief, placed, ref_profile)
            _compare(result, ref, root / "reference", root / name, options.rtol)
            compare_data(result, ref_data, data_epochs(root / name / "audit", len(supervisor.attempts)))
            results.append(result)
    text = render(results, options)
    print(text, file=out or sys.stdout, flush=True)
    if options.report:
        document = {
            "seed": options.seed,
            "runs": options.runs,
            "rtol": options.rtol,
            "matches": all(r.matches for r in results),
            "results": [dataclasses.asdict(r) | {"matches": r.matches} for r in results],
        }
        Path(options.report).write_text(json.dumps(document, indent=2) + "\n")
    return 0 if all(r.matches for r in results) else 1


def _run(job: JobSpec, directory: Path, placed: schedule.Placed | None, grace: float) -> Supervisor:
    shutil.rmtree(directory, ignore_errors=True)  # a rerun starts clean: no checkpoint of an earlier one
    run_job = dataclasses.replace(job, base_output_dir=str(directory), trial=None)
    faults = AuditedFaults(directory / "audit", placed, directory / "hypertune" / "output.metrics")
    restarts = len(placed.faults) if placed is not None else 0
    supervisor = Supervisor(run_job, grace=grace, restarts=restarts, faults=faults)
    supervisor.run()
    return supervisor


def _outcome(
    name: str,
    supervisor: Supervisor,
    directory: Path,
    chief: str,
    placed: schedule.Placed | None,
    ref: schedule.Profile,
) -> Outcome:
    result = Outcome(name, code=supervisor.attempts[-1].code)
    if placed is None:
        return result
    result.kind, result.fault, result.note = placed.kind, placed.describe(), placed.note
    last_step = 0
    for number, attempt in enumerate(supervisor.attempts, 1):
        attempt_dir = directory / "audit" / f"attempt-{number}"
        seen = events(attempt_dir, chief)
        steps = [e["step"] for e in seen if e["event"] == "step"]
        resume = next((e["step"] for e in seen if e["event"] == "resume"), None)
        if number > 1:
            result.resumed_from.append(resume)
            start = resume or 0
            result.repeated += max(0, last_step - start)
            result.lost += max(0, start - last_step)
        last_step = max(steps, default=resume or 0)
        fault = placed.faults.get(number)
        if fault is None:
            if attempt.outcome not in ("succeeded",) and number < len(supervisor.attempts):
                result.differences.append(f"attempt {number} {attempt.outcome} (code {attempt.code})")
            continue
        landed = [e for e in events(attempt_dir, fault.replica) if e["event"] == "fault"]
        if not landed:
            result.landed.append(f"never landed (attempt {number} ended at step {last_step})")
            continue
        result.landed.append(_where(landed[0], ref) + ("" if fault.everyone else f" on {fault.replica}"))
        own = events(attempt_dir, fault.replica)  # a replica that checkpoints on its own commits there
        result.latency.append(_latency(landed[0], own if _commits(own) else seen, fault.signal))
    result.steps = last_step
    return result


def _where(fault: dict[str, Any], ref: schedule.Profile) -> str:
    step, on = fault["step"], fault["on"]
    signal = fault["signal"]
    if on == "save":
        flavour = "async" if fault.get("asynchronous") else "sync"
        return f"{signal} in the {flavour} save of step {step}"
    if fault.get("in_eval"):
        return f"{signal} in evaluation at step {step}"
    end = " (an epoch's last batch)" if step in ref.epoch_ends else ""
    return f"{signal} at step {step}{end}"


def _latency(fault: dict[str, Any], seen: list[dict[str, Any]], signal: str) -> str:
    if signal == "SIGKILL":
        return "-"
    commits = [e for e in _commits(seen) if e["step"] >= fault["step"]]
    if not commits:
        return "no save committed after the notice"
    commit = commits[-1]  # the save the attempt ended with: the preemption save
    return f"{commit['time'] - fault['time']:.2f}s, {commit['step'] - fault['step']} steps"


def _commits(seen: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [e for e in seen if e["event"] == "commit"]


def _compare(result: Outcome, ref: Outcome, ref_dir: Path, run_dir: Path, rtol: float | None) -> None:
    after = _after(result)
    if result.code != ref.code:
        result.differences.append(f"exit code {result.code} (reference {ref.code})")
    files = outputs.compare_files(ref_dir / "model", run_dir / "model", rtol)
    result.within_rtol, result.by_variables = files.within_rtol, files.by_variables
    if files:
        result.differences.append("model files " + files.describe())
        result.hints.append(f"the model differs from the reference {after}: " + _forgotten(result))
    report, ref_report = (outputs.last_report(d / "hypertune" / "output.metrics") for d in (run_dir, ref_dir))
    if report != ref_report and (report is None or ref_report is None):
        result.differences.append(
            "no hypertune report" if report is None else f"a hypertune report {report} (reference: none)"
        )
    elif report != ref_report:
        mine, theirs = report or {}, ref_report or {}
        keys = sorted(k for k in {*mine, *theirs} if mine.get(k) != theirs.get(k))
        shown = ", ".join(f"{k} {mine.get(k)} (reference {theirs.get(k)})" for k in keys)
        result.differences.append(f"last hypertune report: {shown}")
    if result.steps != ref.steps:
        done = "repeated" if result.steps > ref.steps else "skipped"
        result.differences.append(f"{result.steps} optimizer steps (reference {ref.steps})")
        result.hints.append(
            f"{abs(result.steps - ref.steps)} steps {done} {after}: the step counter or the data "
            "position was not restored, or a loader resumed at the wrong batch?"
        )


def compare_data(
    result: Outcome,
    ref: dict[tuple[str, int, int], dict[str, Any]],
    run: dict[tuple[str, int, int], dict[str, Any]],
) -> None:
    """Each epoch's delivered records against the reference's: per reader on the same readers, else
    summed over the readers of each epoch."""
    if not ref and not run:
        return
    per_reader = {e.get("readers") for e in ref.values()} == {e.get("readers") for e in run.values()}

    names = {str(e.get("data")): e.get("source") for e in [*ref.values(), *run.values()]}

    def tallies(
        found: dict[tuple[str, int, int], dict[str, Any]],
    ) -> dict[tuple[str, int, int], tuple[int, int]]:
        out: dict[tuple[str, int, int], tuple[int, int]] = {}
        for (data, epoch, reader), e in found.items():
            key = (data, epoch, reader if per_reader else -1)
            count, digest = out.get(key, (0, 0))
            out[key] = (count + int(e["count"]), (digest + int(e["digest"], 16)) % (1 << 64))
        return out

    ours, theirs = tallies(run), tallies(ref)
    differ = []
    for key in sorted({*ours, *theirs}):
        (count, digest), (ref_count, ref_digest) = ours.get(key, (0, 0)), theirs.get(key, (0, 0))
        if (count, digest) == (ref_count, ref_digest):
            continue
        data, epoch, reader = key
        which = f"records of epoch {epoch}" + (f" of {names[data]}" if len(names) > 1 else "")
        which += f" (reader {reader})" if reader >= 0 else ""
        if count > ref_count:
            what = "delivered more than once"
        elif count < ref_count:
            what = "never delivered"
        else:
            what = "delivered more than once and others never delivered"
        differ.append(f"{which} {what} (count {count} vs {ref_count})")
    matched = len(theirs) - sum(1 for key in theirs if ours.get(key) != theirs[key])
    result.data_audit = f"{matched} of {len(theirs)} epoch data digests match the reference" + (
        "" if per_reader else " (summed over readers: the readers differ)"
    )
    result.differences.extend(differ)
    if differ:
        result.hints.append(
            f"the data delivered differs from the reference {_after(result)}: was the data reader's state "
            "(state_dict) saved with the checkpoint and restored (load_state_dict) before reading on?"
        )


def _after(result: Outcome) -> str:
    landed = result.landed[0] if result.landed else "the fault"
    resumed = next((r for r in result.resumed_from if r is not None), None)
    return f"after a {landed}" + (f" (resumed from step {resumed})" if resumed is not None else "")


def _forgotten(result: Outcome) -> str:
    if result.resumed_from and all(r is None for r in result.resumed_from):
        return "no checkpoint was restored: does the script restore() at start and save on preemption?"
    return "the optimizer state, the RNG or the data position was not restored?"


def render(results: list[Outcome], options: Options) -> str:
    """The report: a table, hints, and one summary line."""
    header = ("run", "fault", "where it landed", "resumed from", "repeated/lost", "differs", "latency")
    rows = [header]
    for r in results[1:]:
        resumed = ", ".join("start" if s is None else f"step {s}" for s in r.resumed_from) or "-"
        rows.append(
            (
                r.name,
                r.kind,
                "; ".join(r.landed) or "-",
                resumed,
                f"{r.repeated}/{r.lost}",
                "; ".join(r.differences) or "nothing",
                "; ".join(r.latency) or "-",
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip() for row in rows]
    ref = results[0]
    lines.insert(0, f"reference: exit code {ref.code}, {ref.steps} steps")
    for r in results:
        for note in (r.note, *r.hints):
            if note:
                lines.append(f"{r.name}: {note}")
        if r.data_audit:
            lines.append(f"{r.name}: data audit: {r.data_audit}")
        if r.within_rtol:
            lines.append(f"{r.name}: within --chaos-rtol {options.rtol:g}: " + ", ".join(r.within_rtol))
        if r.by_variables:
            shown = ", ".join(r.by_variables)
            lines.append(f"{r.name}: same SavedModel variables, other function ids: {shown}")
    failed = [r for r in results[1:] if not r.matches]
    faulted = len(results) - 1
    if not ref.matches:
        lines.append(f"chaos seed {options.seed}: no certificate: " + "; ".join(ref.differences))
    elif failed:
        names = ", ".join(r.name for r in failed)
        lines.append(
            f"chaos seed {options.seed}: {len(failed)} of {faulted} faulted runs differ from the reference "
            f"({names})"
        )
    else:
        lines.append(f"chaos seed {options.seed}: all {faulted} faulted runs match the reference")
    return "\n".join(lines)


def _say(message: str) -> None:
    print(f"[local-run --chaos] {message}", file=sys.stderr, flush=True)

"""Hyperparameter-tuning metrics and trial arguments, compatible with Vertex AI's tuning service.

`report` writes exactly what `cloudml-hypertune` writes (the file the tuning service reads), but only
from the chief, refuses NaN/inf/non-numeric values, and warns when the tag is not the one being tuned.

cloudml-hypertune (0.1.0.dev6) is not a dependency, though its file format is kept byte for byte
(tests/test_hypertune.py writes both and compares): all it would contribute is five fields serialised by
``json.dumps(sort_keys=True)``, and writing through it would drop the checks this module exists for. Its
``HyperTune`` rewrites the metric file in place (``open(path, "w")``: the service can read it empty or half
written; here a temporary file is renamed over it); keeps its last 100 reports per instance with no lock
(two reporters, threads or instances, overwrite each other's lines; here one queue per file under a lock);
creates the directory after an ``exists`` check, which crashes on a bare file name and races another process;
writes ``float(value)`` unchecked (``"nan"``) from every rank; and has no hook to change any of that short of
overriding its private ``_dump_metrics_to_file``.
`parse_args` reads the trial's `--name=value` / `--name value` flags, tolerates integers that arrive as
`"256.0"`, and ignores unknown flags (with a warning) only when asked.

Example:
    >>> import argparse
    >>> from vertexrt import hypertune
    >>> parser = argparse.ArgumentParser()
    >>> _ = parser.add_argument("--batch_size", type=int, default=32)
    >>> hypertune.parse_args(parser, ["--batch_size=256.0"]).batch_size
    256
    >>> hypertune.report("accuracy", 0.91, step=3)  # doctest: +SKIP
    True
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import logging
import math
import os
import sys
import threading
import time
from collections.abc import Sequence
from typing import Any

from vertexrt.errors import ConfigError, MetricError

logger = logging.getLogger(__name__)

DEFAULT_METRIC_FILE = "/tmp/hypertune/output.metrics"
DEFAULT_METRIC_TAG = "training/hptuning/metric"
MAX_ENTRIES = 100  # cloudml-hypertune keeps (and rewrites) only the last 100 reports

_lock = threading.Lock()
_queues: dict[str, collections.deque[str]] = {}  # per metric file: its last 100 lines
_warned_tags: set[tuple[str, str]] = set()
_warned_world = False


def is_chief() -> bool:
    """Whether this process is the one that reports (rank 0), from `vertexrt.distributed.world_info()`.

    A report must never kill a training run: when the cluster variables cannot be read (a stray
    `WORLD_SIZE`, `LOCAL_RANK` or `TORCHELASTIC_RUN_ID` alone), it warns once and answers True, so the
    metric is written as cloudml-hypertune would write it.
    """
    global _warned_world
    from vertexrt.distributed import world_info

    try:
        return bool(world_info().is_chief)
    except ConfigError as err:
        if not _warned_world:
            _warned_world = True
            logger.warning("hypertune: cannot tell this process's rank (%s); writing the metric anyway", err)
        return True


def metric_file() -> str:
    """The file the tuning service reads: `$CLOUD_ML_HP_METRIC_FILE` or `/tmp/hypertune/output.metrics`."""
    return os.environ.get("CLOUD_ML_HP_METRIC_FILE", DEFAULT_METRIC_FILE)


def _as_float(metric_tag: str, value: object) -> float:
    if isinstance(value, (str, bytes, bool)):
        raise MetricError(f"hypertune metric {metric_tag!r}: value {value!r} is not a number; report a float")
    try:
        number = float(value)  # type: ignore[arg-type]  # int, float, numpy/torch/tf scalars
    except (TypeError, ValueError, OverflowError) as err:
        raise MetricError(
            f"hypertune metric {metric_tag!r}: value {value!r} ({type(value).__name__}) is not a number; "
            "report a float (e.g. `loss.item()`)"
        ) from err
    if not math.isfinite(number):
        raise MetricError(
            f"hypertune metric {metric_tag!r}: value is {number}; the tuning service needs a finite number "
            "(check the training run for divergence before reporting)"
        )
    return number


def _as_step(metric_tag: str, step: object) -> int:
    """cloudml-hypertune's `int(step) if step else 0`, with a typed error for what `int()` refuses."""
    if not step:
        return 0
    try:
        return int(step)  # type: ignore[call-overload]
    except (TypeError, ValueError, OverflowError) as err:
        raise MetricError(
            f"hypertune metric {metric_tag!r}: step={step!r} is not an integer; pass the global step "
            "(e.g. `step=epoch`) or leave it out"
        ) from err


def _as_tag(metric_tag: object) -> str:
    if not isinstance(metric_tag, str):
        raise MetricError(
            f"hypertune metric tag {metric_tag!r} ({type(metric_tag).__name__}) is not a string; pass the "
            "study's metricId, e.g. report('accuracy', 0.9)"
        )
    return metric_tag or DEFAULT_METRIC_TAG


def _check_tag(metric_tag: str) -> None:
    expected = os.environ.get("CLOUD_ML_HP_METRIC_TAG")
    if expected and expected != metric_tag and (expected, metric_tag) not in _warned_tags:
        _warned_tags.add((expected, metric_tag))
        logger.warning(
            "hypertune metric %r is not the metric this study optimises (CLOUD_ML_HP_METRIC_TAG=%r): "
            "the tuning service will not see it. Report %r instead (it must match the study's metricId).",
            metric_tag,
            expected,
            expected,
        )


def _write(path: str, lines: Sequence[str]) -> None:
    """Replace `path` with `lines` atomically (a reader never sees a half-written file); nothing is left
    behind on failure."""
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        directory = os.path.dirname(path)
        if directory:
            os.makedirs(directory, exist_ok=True)
        with open(tmp, "w") as f:
            f.write("".join(lines))
        os.replace(tmp, path)
    except OSError as err:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise ConfigError(
            f"hypertune: cannot write the metric file {path!r} (CLOUD_ML_HP_METRIC_FILE): "
            f"{err.strerror or err}; "
            "set CLOUD_ML_HP_METRIC_FILE to a writable file path, or unset it for the default "
            f"{DEFAULT_METRIC_FILE}"
        ) from err


def earlier_file(path: str | None = None) -> str:
    """The side file keeping an earlier attempt's reports (a restarted trial), beside the metric file."""
    return (metric_file() if path is None else path) + ".earlier"


def _keep_earlier(path: str) -> None:
    """Before this process first rewrites ``path``: append what an earlier attempt left there to
    :func:`earlier_file`, which the tuning service does not read (the metric file itself stays exactly
    what cloudml-hypertune writes)."""
    try:
        with open(path, "rb") as f:
            earlier = f.read(MAX_ENTRIES * 4096)  # bounded: at most 100 reports are ever kept there
    except OSError:
        return
    if not earlier.strip():
        return
    side = earlier_file(path)
    try:
        with open(side, "ab") as f:
            f.write(earlier if earlier.endswith(b"\n") else earlier + b"\n")
    except OSError as err:
        logger.warning("hypertune: cannot keep the earlier reports of %s in %s: %s", path, side, err)
        return
    logger.info("hypertune: %s held an earlier attempt's reports; they are kept in %s", path, side)


def report(metric_tag: str, value: float, step: int | None = None, checkpoint_path: str = "") -> bool:
    """Report a hyperparameter-tuning metric the way cloudml-hypertune does; return whether it was written.

    Writes `$CLOUD_ML_HP_METRIC_FILE` (default `/tmp/hypertune/output.metrics`) with the last 100 reports of
    this process, one JSON object per line, trial from `$CLOUD_ML_TRIAL_ID`. What an earlier attempt (a
    restarted trial) left in the file is first appended to `<file>.earlier` (see `earlier_file`). Non-chief
    processes write nothing and return False (see `is_chief`). NaN, infinite or non-numeric values, a step
    that is not an integer and a tag that is not a string raise `MetricError` (a ValueError); a metric file
    that cannot be written raises `ConfigError` and leaves no temporary file. An empty tag becomes
    `training/hptuning/metric`, as in cloudml-hypertune.

    Example:
        >>> report("val_accuracy", 0.93, step=1200)  # doctest: +SKIP
        True
    """
    tag = _as_tag(metric_tag)
    number = _as_float(tag, value)
    global_step = _as_step(tag, step)
    _check_tag(tag)
    if not is_chief():
        logger.debug("hypertune metric %s=%s not reported: not the chief", tag, number)
        return False
    entry = {
        "timestamp": time.time(),
        "trial": str(os.environ.get("CLOUD_ML_TRIAL_ID", 0)),
        tag: str(number),
        "global_step": str(global_step),
        "checkpoint_path": checkpoint_path,
    }
    path = metric_file()
    line = json.dumps(entry, sort_keys=True) + "\n"  # cloudml-hypertune's exact serialisation
    with _lock:
        if path not in _queues:
            _keep_earlier(path)
        lines = _queues.setdefault(path, collections.deque(maxlen=MAX_ENTRIES))
        _write(path, [*list(lines)[1 - MAX_ENTRIES :], line])
        lines.append(line)  # only once written: a failed report is not replayed later
    logger.info("hypertune metric %s=%s (step %s) -> %s", tag, number, entry["global_step"], path)
    return True


def _tolerant_int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        number = float(text)  # the tuner sends discrete/integer parameters as "256.0"
        if not number.is_integer():
            raise ValueError(f"{text!r} is not an integer") from None
        return int(number)


def _tolerant_bool(text: str) -> bool:
    lowered = text.strip().lower()
    if lowered in ("1", "true", "t", "yes", "y", "1.0"):
        return True
    if lowered in ("0", "false", "f", "no", "n", "0.0"):
        return False
    raise ValueError(f"{text!r} is not a boolean")


_tolerant_int.__name__ = "int"  # argparse names the type in "invalid int value: ..."
_tolerant_bool.__name__ = "bool"
_TOLERANT: dict[Any, Any] = {int: _tolerant_int, bool: _tolerant_bool}


def add_job_dir(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add `--job-dir` (also `--job_dir`), the output directory legacy and prebuilt launchers pass.

    Example:
        >>> add_job_dir(argparse.ArgumentParser()).parse_args(["--job-dir", "gs://b/out"]).job_dir
        'gs://b/out'
    """
    if "--job-dir" not in parser._option_string_actions:
        parser.add_argument(
            "--job-dir", "--job_dir", dest="job_dir", default=None, help="output directory (gs:// or local)"
        )
    return parser


def _normalise_flags(parser: argparse.ArgumentParser, argv: Sequence[str]) -> list[str]:
    """Rewrite `--learning_rate` to `--learning-rate` (or back) when only the other spelling is declared."""
    known = parser._option_string_actions
    out: list[str] = []
    for token in argv:
        if token == "--":
            out.extend(argv[len(out) :])
            break
        if token.startswith("--"):
            name, sep, rest = token.partition("=")
            if name not in known:
                for swapped in (name[:2] + name[2:].replace("_", "-"), name[:2] + name[2:].replace("-", "_")):
                    if swapped in known:
                        token = swapped + sep + rest
                        break
        out.append(token)
    return out


def parse_args(
    parser: argparse.ArgumentParser, argv: Sequence[str] | None = None, ignore_unknown: bool = False
) -> argparse.Namespace:
    """Parse a trial's arguments: `--name=value` and `--name value`, `--job-dir`, `"256.0"` for ints.

    `int`-typed arguments accept integral floats (`"256.0"`), `bool`-typed ones accept true/false/1/0,
    `--a_b` matches a declared `--a-b` (and the reverse). `--job-dir` is added if missing. Unknown flags
    are an error (argparse's exit) unless `ignore_unknown=True`, which logs a warning naming them.

    Example:
        >>> p = argparse.ArgumentParser()
        >>> _ = p.add_argument("--lr", type=float)
        >>> parse_args(p, ["--lr", "0.1", "--extra=1"], ignore_unknown=True).lr
        0.1
    """
    add_job_dir(parser)
    args = _normalise_flags(parser, sys.argv[1:] if argv is None else argv)
    swapped = [(action, action.type) for action in parser._actions if action.type in _TOLERANT]
    for action, kind in swapped:
        action.type = _TOLERANT[kind]
    try:
        namespace, unknown = parser.parse_known_args(args)
    finally:
        for action, kind in swapped:
            action.type = kind
    if unknown:
        if not ignore_unknown:
            parser.error(
                f"unrecognized arguments: {' '.join(unknown)} (declare them, or pass ignore_unknown=True "
                "to vertexrt.hypertune.parse_args to ignore them with a warning)"
            )
        logger.warning("ignoring unknown arguments: %s", " ".join(unknown))
    return namespace

"""What a chaos run is compared on: the files under ``AIP_MODEL_DIR`` and the last hypertune report.

Files are compared byte for byte; with ``rtol``, a file that differs and parses (JSON, NumPy ``.npy`` /
``.npz``, a torch file of tensors) is compared number by number within that relative tolerance, and the
report names the files that needed it.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass
class FileDifference:
    """How the model files of a run differ from the reference's."""

    missing: list[str] = field(default_factory=list)
    extra: list[str] = field(default_factory=list)
    differ: list[str] = field(default_factory=list)
    within_rtol: list[str] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.missing or self.extra or self.differ)

    def describe(self) -> str:
        parts = []
        for what, names in (("missing", self.missing), ("extra", self.extra), ("differ", self.differ)):
            if names:
                shown = ", ".join(names[:3]) + (f" (+{len(names) - 3})" if len(names) > 3 else "")
                parts.append(f"{what}: {shown}")
        return "; ".join(parts)


def model_files(directory: Path) -> dict[str, Path]:
    """Every file under ``directory`` by its path relative to it."""
    if not directory.is_dir():
        return {}
    return {p.relative_to(directory).as_posix(): p for p in sorted(directory.rglob("*")) if p.is_file()}


def compare_files(reference: Path, run: Path, rtol: float | None) -> FileDifference:
    """The files under ``run`` against those under ``reference``."""
    ours, theirs = model_files(reference), model_files(run)
    result = FileDifference(
        missing=[n for n in ours if n not in theirs], extra=[n for n in theirs if n not in ours]
    )
    for name, path in ours.items():
        other = theirs.get(name)
        if other is None or path.read_bytes() == other.read_bytes():
            continue
        if rtol is not None and _close(path, other, rtol):
            result.within_rtol.append(name)
        else:
            result.differ.append(name)
    return result


def last_report(metric_file: Path) -> dict[str, Any] | None:
    """The last hypertune report in ``metric_file`` without its timestamp, or None."""
    try:
        lines = [line for line in metric_file.read_text().splitlines() if line.strip()]
    except OSError:
        return None
    if not lines:
        return None
    try:
        report = json.loads(lines[-1])
    except ValueError:
        return {"unreadable": lines[-1]}
    return {k: v for k, v in report.items() if k != "timestamp"} if isinstance(report, dict) else None


def _close(a: Path, b: Path, rtol: float) -> bool:
    left, right = _numbers(a), _numbers(b)
    if left is None or right is None or len(left) != len(right):
        return False
    return all(x == y or _near(x, y, rtol) for x, y in zip(left, right, strict=True))


def _near(x: Any, y: Any, rtol: float) -> bool:
    numbers = isinstance(x, float) and isinstance(y, float)
    return numbers and math.isclose(x, y, rel_tol=rtol, abs_tol=rtol)


def _numbers(path: Path) -> list[Any] | None:
    """The values in ``path`` in a stable order (numbers as floats), when it parses as JSON, NumPy or a
    torch file."""
    suffix = path.suffix
    try:
        if suffix == ".json":
            return _flatten(json.loads(path.read_text()))
        if suffix in (".npy", ".npz"):
            import numpy as np

            loaded = np.load(path, allow_pickle=False)
            arrays = [loaded[k] for k in sorted(loaded.files)] if suffix == ".npz" else [loaded]
            return [float(x) for array in arrays for x in np.ravel(array)]
        if suffix in (".pt", ".pth", ".bin"):
            import torch

            return _flatten(torch.load(path, map_location="cpu", weights_only=True))
    except Exception:  # noqa: BLE001 - a file that does not parse is compared by bytes only
        return None
    return None


def _flatten(value: Any) -> list[Any]:
    if isinstance(value, (bool, int, float)):
        return [float(value)]
    if isinstance(value, dict):
        return [x for key in sorted(value, key=str) for x in _flatten(value[key])]
    if isinstance(value, (list, tuple)):
        return [x for item in value for x in _flatten(item)]
    if hasattr(value, "detach"):  # a torch tensor
        return [float(x) for x in value.detach().cpu().double().flatten().tolist()]
    return [repr(value)]  # compared for equality

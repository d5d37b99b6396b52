"""What a chaos run is compared on: the files under ``AIP_MODEL_DIR`` and the last hypertune report.

Files are compared byte for byte; with ``rtol``, a file that differs and parses (JSON, NumPy ``.npy`` /
``.npz``, a torch file of tensors) is compared number by number within that relative tolerance, and the
report names the files that needed it. A TensorFlow SavedModel whose files differ is compared by its
variables, by name and value: its graph files name functions with per-process counters
(``__inference__traced_restore_4115``), so two runs that trained the same weights write different bytes.
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
    by_variables: list[str] = field(default_factory=list)  # SavedModel files whose variables are equal

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
    roots = {_saved_model_root(reference, name) for name in result.differ}
    for root in sorted(r for r in roots if r is not None):
        if _same_variables(reference / root, run / root, rtol):
            inside = [n for n in result.differ if _saved_model_root(reference, n) == root]
            result.differ = [n for n in result.differ if n not in inside]
            result.by_variables.extend(inside)
    return result


def _saved_model_root(reference: Path, name: str) -> str | None:
    """The directory (relative) of the SavedModel that holds file ``name``, or None."""
    parts = name.split("/")
    for end in range(len(parts) - 1, -1, -1):
        root = "/".join(parts[:end])
        if (reference / root / "saved_model.pb").is_file():
            return root
    return None


def _same_variables(a: Path, b: Path, rtol: float | None) -> bool:
    """Whether two SavedModels hold the same variables: the same names and the same values, exactly as a
    whole (the object graph may list the same variables in another order, e.g. tf-keras's
    ``_all_variables``), or each name within ``rtol``."""
    left, right = _variables(a), _variables(b)
    if left is None or right is None or left.keys() != right.keys():
        return False

    def values(named: dict[str, Any]) -> list[tuple[str, tuple[int, ...], bytes]]:
        return sorted((str(x.dtype), x.shape, x.tobytes()) for x in named.values())

    if values(left) == values(right):
        return True
    if rtol is None:
        return False
    import numpy as np

    for name, x in left.items():
        y = right[name]
        if x.shape != y.shape or x.dtype != y.dtype or not np.issubdtype(x.dtype, np.number):
            return False
        if not np.allclose(x, y, rtol=rtol, atol=rtol):
            return False
    return True


def _variables(saved_model: Path) -> dict[str, Any] | None:
    """A SavedModel's variables by name (its object graph, which names functions, left out), or None."""
    try:
        import tensorflow as tf

        reader = tf.train.load_checkpoint(str(saved_model / "variables" / "variables"))
        names = [n for n in reader.get_variable_to_shape_map() if n != "_CHECKPOINTABLE_OBJECT_GRAPH"]
        return {n: reader.get_tensor(n) for n in names}
    except Exception:  # noqa: BLE001 - not readable (or no TensorFlow): compared by bytes only
        return None


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

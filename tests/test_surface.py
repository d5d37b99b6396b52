"""The package surface: what ``vertexrt`` exports, and that a user's strictly typed script can import it."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest
from jobs import run_job

import vertexrt
import vertexrt.data
import vertexrt.distributed
import vertexrt.errors

ROOT = Path(__file__).resolve().parents[1]
LAZY_PACKAGES = [vertexrt, vertexrt.distributed, vertexrt.data]


@pytest.mark.parametrize("package", LAZY_PACKAGES, ids=lambda p: p.__name__)
def test_all_is_a_literal_list_that_type_checkers_can_read(package) -> None:
    tree = ast.parse(Path(package.__file__).read_text())
    [value] = [
        node.value
        for node in tree.body
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "__all__" for t in node.targets)
    ]
    assert isinstance(value, ast.List) and all(isinstance(e, ast.Constant) for e in value.elts)
    assert [e.value for e in value.elts] == package.__all__


@pytest.mark.parametrize("package", LAZY_PACKAGES, ids=lambda p: p.__name__)
def test_every_exported_name_resolves(package) -> None:
    for name in package.__all__:
        assert getattr(package, name) is not None, name


def test_errors_and_warnings_all_live_in_errors_and_are_exported() -> None:
    from vertexrt.errors import CheckpointCorruptError, CheckpointError, ClusterSpecWarning, VertexrtWarning

    assert vertexrt.CheckpointCorruptError is CheckpointCorruptError
    assert vertexrt.ClusterSpecWarning is ClusterSpecWarning and vertexrt.VertexrtWarning is VertexrtWarning
    err = CheckpointCorruptError("data file step_3/data.00000.bin is truncated", file="step_3/data.00000.bin")
    assert isinstance(err, CheckpointError) and err.file == "step_3/data.00000.bin"
    assert CheckpointCorruptError("manifest unreadable").file is None
    with pytest.raises(TypeError):
        CheckpointCorruptError("x", "positional-file")  # type: ignore[misc]
    for name in vertexrt.__all__:
        value = getattr(vertexrt, name)
        if isinstance(value, type) and issubclass(value, (Exception, Warning)):
            assert value.__module__ == "vertexrt.errors", name


def test_documented_submodules_are_attributes() -> None:
    assert vertexrt.doctor.contract_warnings is not None
    assert {"doctor", "paths", "keras"} <= set(dir(vertexrt))


def test_star_import_needs_no_optional_framework() -> None:
    # TensorFlow and torch are optional extras: `from vertexrt import *` must work without them.
    code = (
        "import sys\n"
        "for name in ('tensorflow', 'torch', 'keras', 'tf_keras'):\n"
        "    sys.modules[name] = None  # an import of it raises ImportError\n"
        "from vertexrt import *\n"
        "print(sorted(m for m in ('tensorflow', 'torch', 'keras') if sys.modules.get(m) is not None))\n"
    )
    out = run_job([sys.executable, "-c", code], None, 120, merge_stderr=False)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]"
    assert "keras" not in vertexrt.__all__


@pytest.mark.slow
def test_a_strictly_typed_consumer_type_checks() -> None:
    # The same check `make lint` runs: mypy --strict on a user's script importing the public API.
    out = run_job(
        [sys.executable, "-m", "mypy", "--strict", "--no-incremental", "tests/typing/consumer.py"],
        ROOT,
        300,
    )
    assert out.returncode == 0, out.stdout[-4000:]


def test_every_error_survives_pickling_with_its_fields() -> None:
    """Errors cross process boundaries (torch.distributed.checkpoint gathers the ranks' exceptions)."""
    import pickle

    from vertexrt import errors

    storage = pickle.loads(pickle.dumps(errors.StorageError("no answer", "writing", "gs://b/x")))
    assert (str(storage), storage.operation, storage.uri) == ("no answer", "writing", "gs://b/x")
    corrupt = pickle.loads(pickle.dumps(errors.CheckpointCorruptError("bad crc", file="gs://b/f")))
    assert (str(corrupt), corrupt.file) == ("bad crc", "gs://b/f")

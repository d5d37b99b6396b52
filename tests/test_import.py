"""`import vertexrt` stays light: no framework, no cloud client, no numpy until used."""

from __future__ import annotations

import sys

from jobs import run_job

HEAVY = (
    "torch",
    "tensorflow",
    "lightning",
    "transformers",
    "gcsfs",
    "fsspec",
    "google.cloud",
    "google.auth",
    "numpy",
    "pyarrow",
)


def _loaded_after(code: str) -> list[str]:
    probe = f"import sys; {code}; print([m for m in {HEAVY!r} if m in sys.modules])"
    out = run_job([sys.executable, "-c", probe], None, 60, merge_stderr=False)
    assert out.returncode == 0, out.stderr[-2000:]
    return eval(out.stdout.strip())  # noqa: S307 - our own list literal


def test_import_is_light():
    assert _loaded_after("import vertexrt") == []


def test_integrations_package_is_light():
    assert _loaded_after("import vertexrt.integrations") == []


def test_environment_is_light():
    assert (
        _loaded_after("import vertexrt; vertexrt.environment(); vertexrt.paths.to_fuse('gs://abc/x')") == []
    )


def test_public_names_resolve_lazily():
    import vertexrt

    assert vertexrt.ConfigError.__module__ == "vertexrt.errors"
    assert callable(vertexrt.environment) and callable(vertexrt.project_id)
    assert "paths" in dir(vertexrt)

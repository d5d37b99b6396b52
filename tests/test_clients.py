"""Cloud clients bound to the project (vertexrt.clients), and the import graph around env and paths."""

from __future__ import annotations

import sys

import pytest
from jobs import run_job

import vertexrt
from vertexrt import clients
from vertexrt.errors import ConfigError


def test_storage_options_bound_to_project_and_emulator(vertex_env, monkeypatch):
    vertex_env(project="314159")
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", "127.0.0.1:9999")
    assert clients.storage_options() == {
        "project": "314159",
        "endpoint_url": "http://127.0.0.1:9999",
        "token": "anon",
    }


def test_bigquery_client_bound_to_project(vertex_env, monkeypatch):
    vertex_env(project="271828")
    monkeypatch.setenv("BIGQUERY_EMULATOR_HOST", "http://127.0.0.1:9050")
    client = clients.bigquery_client()
    assert client.project == "271828"
    assert client._connection.API_BASE_URL == "http://127.0.0.1:9050"


def test_bigquery_client_without_credentials_is_a_config_error_naming_the_fix(
    clean_env, monkeypatch, tmp_path
):
    """What `vertexrt local-run` gives a script on a machine with no Google credentials: a project
    (local-project), no key file, no gcloud login; google-auth's error comes out typed, with the fix."""
    monkeypatch.setenv("CLOUD_ML_PROJECT_ID", "local-project")
    for name in ("BIGQUERY_EMULATOR_HOST", "GOOGLE_APPLICATION_CREDENTIALS"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("CLOUDSDK_CONFIG", str(tmp_path / "gcloud"))  # no application-default login there
    monkeypatch.setenv("NO_GCE_CHECK", "True")  # not a Compute Engine VM: no metadata server to ask
    with pytest.raises(ConfigError, match="gcloud auth application-default login") as raised:
        clients.bigquery_client()
    assert "GOOGLE_APPLICATION_CREDENTIALS" in str(raised.value) and "local-project" in str(raised.value)


def test_top_level_names_come_from_clients():
    assert vertexrt.storage_options is clients.storage_options
    assert vertexrt.bigquery_client is clients.bigquery_client


@pytest.mark.parametrize("module", ["env", "paths", "clients", "uris", "cli", "doctor"])
def test_each_module_imports_alone_and_env_never_loads_paths(module):
    code = (
        "import sys, importlib\n"
        f"importlib.import_module('vertexrt.{module}')\n"
        "import vertexrt.env as env\n"
        "env.environment(); env.project_from_environ()\n"
        "assert 'vertexrt.paths' not in sys.modules or "
        f"'{module}' in ('paths', 'cli', 'doctor'), sorted(sys.modules)\n"
        "assert 'vertexrt.clients' not in sys.modules or "
        f"'{module}' in ('clients', 'cli', 'doctor'), sorted(sys.modules)\n"
    )
    done = run_job([sys.executable, "-c", code], None, 60)
    assert done.returncode == 0, done.stdout[-3000:]


def test_no_cycle_between_env_paths_and_clients():
    import ast
    import pathlib

    def imports(name: str) -> set[str]:
        tree = ast.parse(pathlib.Path(vertexrt.__file__).with_name(f"{name}.py").read_text())
        found = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("vertexrt"):
                found |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
            elif isinstance(node, ast.Import):
                found |= {a.name for a in node.names}
        return {m.removeprefix("vertexrt.") for m in found if m.startswith("vertexrt.")}

    assert not imports("env") & {"paths", "clients"}
    assert not imports("uris") & {"env", "paths", "clients"}
    assert "env" not in imports("paths")
    assert "paths" not in imports("clients")

"""``local_run``: the launcher as a subprocess, through the one runner (``jobs.run_tree``)."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from jobs import Run, run_tree

SCRIPTS = Path(__file__).parent / "scripts"


@pytest.fixture
def local_run(tmp_path: Path) -> Callable[..., Run]:
    """``local_run("--workers", "2", "--", script, *args, timeout=120)``: the launcher as a subprocess.

    A script name without a slash is taken from ``tests/distributed/scripts`` and run with this Python.
    """

    def launch(*args: str, timeout: float = 120, env: dict[str, str] | None = None, **stop: object) -> Run:
        argv = list(args)
        split = argv.index("--")
        options, command = argv[:split], argv[split + 1 :]
        if command and command[0].endswith(".py") and "/" not in command[0]:
            command = [sys.executable, str(SCRIPTS / command[0]), *command[1:]]
        full = [
            sys.executable,
            "-m",
            "vertexrt.distributed.launcher",
            "--grace",
            "3",
            *options,
            "--",
            *command,
        ]
        return run_tree(full, timeout=timeout, cwd=tmp_path, env=env, **stop)  # type: ignore[arg-type]

    return launch

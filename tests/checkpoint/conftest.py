"""Fixtures for checkpoint tests."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable

import pytest

from .ckpt_helpers import read_bytes, write_bytes


@pytest.fixture
def dead_pid() -> int:
    """The pid of a process that has exited (and been reaped)."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait(timeout=30)
    return proc.pid


@pytest.fixture
def flip_byte() -> Callable[[str, int], None]:
    def flip(uri: str, offset: int) -> None:
        data = bytearray(read_bytes(uri))
        data[offset] ^= 0xFF
        write_bytes(uri, bytes(data))

    return flip

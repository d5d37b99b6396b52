"""TensorBoard: where to write (`AIP_TENSORBOARD_LOG_DIR`) and a summary writer that works with `gs://`.

`writer()` wraps tf.summary (when TensorFlow is already imported), torch's SummaryWriter or tensorboardX, or
writes scalars alone with no framework (``backend="scalars"``, `vertexrt.tensorboard_events`: the Trainer's).
For a `gs://` or `/gcs/` directory it writes event files to a local staging directory and, every
`upload_interval` seconds and at `close()`, sends what each file gained through `vertexrt.paths`
(composed onto the object: a growing file is never re-uploaded whole). torch cannot write `gs://`
without TF, and appending many small events through the FUSE mount is slow. Only the chief
writes by default; other processes get a writer that does nothing.

Example:
    >>> from vertexrt import tensorboard
    >>> with tensorboard.writer() as tb:  # doctest: +SKIP
    ...     for step in range(100):
    ...         tb.scalar("loss", 1.0 / (step + 1), step)
    ...     tb.add_histogram("weights", weights, 99)  # any method of the wrapped writer
"""

from __future__ import annotations

import atexit
import contextlib
import importlib.util
import json
import logging
import os
import shutil
import sys
import tempfile
import threading
from typing import Any

from vertexrt.errors import ConfigError

logger = logging.getLogger(__name__)

BACKENDS = ("tf", "torch", "tensorboardX", "files", "scalars")
#: Seconds ``close()`` may spend on the last upload once a preemption notice arrived: the grace between
#: SIGTERM and SIGKILL belongs to the checkpoint (events not uploaded by then are lost with the VM).
PREEMPTED_UPLOAD_SECONDS = 2.0


def log_dir() -> str:
    """`$AIP_TENSORBOARD_LOG_DIR` (no trailing slash), else the local fallback `.../logs`.

    Example:
        >>> log_dir()  # doctest: +SKIP
        'gs://my-bucket/output/3/logs'
    """
    from vertexrt.env import environment

    return environment().tensorboard_log_dir


_env_log_dir = log_dir  # writer()'s `log_dir` parameter shadows the name


def _auto_backend() -> str:
    if "tensorflow" in sys.modules:
        return "tf"
    if importlib.util.find_spec("torch") and importlib.util.find_spec("tensorboard"):
        return "torch"
    if importlib.util.find_spec("tensorboardX"):
        return "tensorboardX"
    if importlib.util.find_spec("tensorflow"):
        return "tf"
    raise ConfigError(
        "vertexrt.tensorboard.writer needs TensorFlow, torch (with the tensorboard package) or tensorboardX; "
        "install one, e.g. `pip install tensorboard`"
    )


class _FilesOnly:
    """The ``files`` backend: another writer (e.g. Keras's TensorBoard callback) writes the event files."""

    def flush(self) -> None:
        pass

    def close(self) -> None:
        pass


def _open_native(backend: str, directory: str) -> Any:
    if backend == "files":
        return _FilesOnly()
    if backend == "scalars":
        from vertexrt.tensorboard_events import ScalarEventWriter

        return ScalarEventWriter(directory)
    if backend == "tf":
        import tensorflow as tf

        return tf.summary.create_file_writer(directory)
    if backend == "torch":
        from torch.utils.tensorboard import SummaryWriter as TorchWriter

        return TorchWriter(log_dir=directory)
    from tensorboardX import SummaryWriter as XWriter

    return XWriter(logdir=directory)


class SummaryWriter:
    """A summary writer bound to one log directory; `gs://` and `/gcs/` are staged locally and uploaded.

    `scalar(tag, value, step)` works the same on every backend; any other attribute is the wrapped
    writer's (`add_histogram` for torch, `as_default()` for tf), also available as `.native`.
    On a non-chief process (`enabled` is False) every call does nothing.
    """

    def __init__(self, target: str | None, backend: str | None, upload_interval: float = 60.0) -> None:
        self.log_dir = target
        self.backend = backend
        self.local_dir: str | None = None
        self.native: Any = None
        self._staged = False
        self._uploaded: dict[str, int] = {}  # staged file -> bytes already uploaded
        self.bytes_uploaded = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if target is None or backend is None:
            return
        from vertexrt import paths

        self._staged = paths.storage_kind(target) != "local"
        if self._staged:
            self.local_dir = tempfile.mkdtemp(prefix="vertexrt-tensorboard-")
        else:
            self.local_dir = target
            os.makedirs(target, exist_ok=True)
        self.native = _open_native(backend, self.local_dir)
        if self._staged:
            self._thread = threading.Thread(
                target=self._upload_loop, args=(upload_interval,), name="vertexrt-tensorboard", daemon=True
            )
            self._thread.start()
        atexit.register(self.close)

    @property
    def enabled(self) -> bool:
        """False on a non-chief process: nothing is written."""
        return self.native is not None

    def scalar(self, tag: str, value: float, step: int) -> None:
        """Record one scalar at `step`."""
        if self.native is None:
            return
        if self.backend == "files":
            raise ConfigError(
                "a writer(backend='files') only uploads what another writer wrote: it has no scalar()"
            )
        if self.backend == "tf":
            import tensorflow as tf

            with self.native.as_default():
                tf.summary.scalar(tag, value, step=step)
        else:
            self.native.add_scalar(tag, value, step)

    def scalars(self, values: dict[str, float], step: int) -> None:
        """Record several scalars at `step` (one tag each)."""
        for tag, value in values.items():
            self.scalar(tag, value, step)

    def flush(self) -> None:
        """Write buffered events to disk and, for a remote log dir, upload the changed event files."""
        if self.native is not None:
            self.native.flush()
            if self._staged:
                self._sync(raise_errors=True)

    def close(self, timeout: float | None = None) -> None:
        """Flush, close the wrapped writer, upload what is left and remove the staging directory.

        Waits at most ``timeout`` seconds (default: as long as it takes, but ``PREEMPTED_UPLOAD_SECONDS``
        once a preemption notice arrived, also at exit): what is not uploaded by then is left behind with a
        warning, so that a preempted replica exits inside its grace period.
        """
        if self.native is None:
            return
        atexit.unregister(self.close)
        self._stop.set()
        if timeout is None and _preemption_notice():
            timeout = PREEMPTED_UPLOAD_SECONDS
        native, self.native = self.native, None
        closing = threading.Thread(
            target=self._finish, args=(native,), name="vertexrt-tensorboard", daemon=True
        )
        try:
            closing.start()
        except RuntimeError:  # no new threads at interpreter shutdown (Python >= 3.12): finish here
            self._finish(native)
            return
        closing.join(timeout)
        if closing.is_alive():
            logger.warning(
                "TensorBoard: the last upload to %s did not finish within %.0f s; it is left unfinished so "
                "that a preempted replica exits inside its grace period",
                self.log_dir,
                timeout,
            )

    def _finish(self, native: Any) -> None:
        if self._thread is not None:
            self._thread.join()
        native.close()
        if self._staged and self.local_dir is not None:
            try:
                self._sync(raise_errors=True)
            except OSError as err:
                logger.error(
                    "TensorBoard events could not be uploaded to %s (%s); they are kept in %s",
                    self.log_dir,
                    err,
                    self.local_dir,
                )
            else:
                shutil.rmtree(self.local_dir, ignore_errors=True)

    def __getattr__(self, name: str) -> Any:
        native = self.__dict__.get("native")
        if native is None:
            return _noop
        return getattr(native, name)

    def __enter__(self) -> SummaryWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _upload_loop(self, interval: float) -> None:
        while not self._stop.wait(interval):
            native = self.native
            try:
                if native is not None:
                    native.flush()
                self._sync(raise_errors=False)
            except Exception as err:  # never let telemetry kill training; retried next tick
                logger.warning("TensorBoard flush for %s failed: %s; retrying later", self.log_dir, err)

    def _sync(self, raise_errors: bool) -> None:
        """Send what each staged event file gained since its last upload (event files only grow)."""
        assert self.local_dir is not None and self.log_dir is not None
        with self._lock:
            for root, _, files in os.walk(self.local_dir):
                for name in sorted(files):
                    local = os.path.join(root, name)
                    rel = os.path.relpath(local, self.local_dir)
                    try:
                        self._upload(local, rel)
                    except OSError as err:
                        if raise_errors:
                            raise
                        logger.warning("TensorBoard upload of %s failed: %s; retrying later", rel, err)

    def _upload(self, local: str, rel: str) -> None:
        from vertexrt import paths

        done = self._uploaded.get(local, 0)
        with open(local, "rb") as src:
            src.seek(done)
            delta = src.read()
        if not delta:
            return
        remote = paths.join(self.log_dir or "", rel)
        if done == 0:
            with paths.open(remote, "wb") as dst:
                dst.write(delta)
        else:  # append, never re-upload: a growing file re-sent whole costs O(size^2) over a run
            fs, path = paths.filesystem(remote)
            if "file" in fs.protocol:  # the /gcs/ mount
                with fs.open(path, "ab") as dst:
                    dst.write(delta)
            else:
                _append_object(fs, path, done, delta)
        self._uploaded[local] = done + len(delta)
        self.bytes_uploaded += len(delta)


def _append_object(fs: Any, path: str, done: int, delta: bytes) -> None:
    """Append ``delta`` (the local file's bytes from offset ``done`` on) to the object ``path``: upload it,
    compose it on, delete it. Nothing is appended twice: the compose is sent once, and the next attempt
    reads from the object's size how much of an earlier one landed. A delta object that could not be
    deleted is left behind with a warning, not sent again."""
    fs.invalidate_cache(path)
    landed = fs.size(path) - done  # > 0: an earlier attempt's compose landed, its answer was lost
    if landed > len(delta):
        raise OSError(f"gs://{path} holds {done + landed} bytes, more than the {done + len(delta)} staged")
    if landed > 0:
        delta, done = delta[landed:], done + landed
        if not delta:
            return
    part = f"{path}.vertexrt-part-{done}"
    fs.pipe_file(part, delta)
    try:
        _compose_once(fs, path, part)
    finally:
        try:
            fs.rm_file(part)
        except Exception as err:  # the events are appended: a stray part object only costs storage
            logger.warning("TensorBoard: could not delete %s (%s); delete it by hand", part, err)


_COMPOSE_TIMEOUT = 60.0  # seconds for the one compose request; one that times out is retried at the next sync


def _compose_once(fs: Any, path: str, part: str) -> None:
    """``fs.merge(path, [path, part])`` sent once, as one JSON API request with ``fs``'s credentials.
    gcsfs retries a request whose answer was lost, and a compose is not idempotent: the retry appends the
    part a second time. The caller's next attempt reads from the object's size how much landed."""
    import urllib.parse
    import urllib.request  # ~15 ms: only when a sync appends

    bucket, key, _ = fs.split_path(path)
    body = {
        "sourceObjects": [{"name": key}, {"name": fs.split_path(part)[1]}],
        "kind": "storage#composeRequest",
        "destination": {"name": key, "bucket": bucket},
    }
    headers = {"Content-Type": "application/json"}
    fs.credentials.apply(headers)  # the Authorization header, refreshed when due (none when anonymous)
    url = f"{fs.base}b/{urllib.parse.quote(bucket, safe='')}/o/{urllib.parse.quote(key, safe='')}/compose"
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers=headers, method="POST")
    try:
        urllib.request.urlopen(request, timeout=_COMPOSE_TIMEOUT).close()
    except OSError as err:  # HTTPError, URLError, timeouts: retried at the next sync
        raise OSError(f"appending to gs://{path} failed: {err}") from err


def _preemption_notice() -> bool:
    """True once SIGTERM arrived in a process that listens for it (vertexrt's signal owner is loaded)."""
    signals = sys.modules.get("vertexrt.preemption.signals")
    return signals is not None and bool(signals.preemption_signal().requested)


def _noop(*args: Any, **kwargs: Any) -> contextlib.nullcontext[None]:
    """What a disabled writer's methods do: nothing (usable as `with tb.as_default():` too)."""
    return contextlib.nullcontext()


def writer(
    log_dir: str | None = None,
    *,
    backend: str = "auto",
    chief_only: bool = True,
    upload_interval: float = 60.0,
) -> SummaryWriter:
    """A summary writer for `log_dir` (default: `vertexrt.tensorboard.log_dir()`).

    `backend`: "auto" (tf if TensorFlow is imported, else torch, else tensorboardX, else tf), "tf",
    "torch", "tensorboardX", "scalars" (`scalar()` only, with no framework: never imports TensorFlow, which
    torch's writer does whenever it is installed), or "files" (no writer of its own: it stages and uploads
    the event files that another writer puts in `local_dir`, e.g. Keras's TensorBoard callback). With
    `chief_only` (default) only rank 0 writes; other ranks get a writer whose methods do nothing. Remote
    directories (`gs://`, `/gcs/`) are uploaded every `upload_interval` seconds, on `flush()` and on
    `close()` (also at interpreter exit).

    Example:
        >>> with writer("gs://my-bucket/run-1/logs") as tb:  # doctest: +SKIP
        ...     tb.scalar("accuracy", 0.9, step=10)
    """
    from vertexrt.hypertune import is_chief

    if chief_only and not is_chief():
        return SummaryWriter(None, None)
    chosen = _auto_backend() if backend == "auto" else backend
    if chosen not in BACKENDS:
        raise ConfigError(
            f"vertexrt.tensorboard.writer: unknown backend {backend!r}; use 'auto' or {BACKENDS}"
        )
    return SummaryWriter(log_dir or _env_log_dir(), chosen, upload_interval)

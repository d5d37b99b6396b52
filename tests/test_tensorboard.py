"""vertexrt.tensorboard: log dir from the contract, a writer that lands readable events on local and gs://."""

from __future__ import annotations

import contextlib
import os
import time
import uuid

import pytest

from vertexrt import hypertune, paths, tensorboard
from vertexrt.errors import ConfigError
from vertexrt.tensorboard import writer

pytest.importorskip("tensorboard")
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # noqa: E402


def _download(root: str, dest) -> str:
    """Copy a (local or gs://) log dir to a local directory EventAccumulator can read."""
    fs, path = paths.filesystem(root)
    for remote in fs.find(path):
        rel = os.path.relpath(remote, path)
        os.makedirs(os.path.join(dest, os.path.dirname(rel)), exist_ok=True)
        with fs.open(remote, "rb") as src, open(os.path.join(dest, rel), "wb") as dst:
            dst.write(src.read())
    return str(dest)


def _scalars(directory: str, tag: str) -> list[tuple[int, float]]:
    acc = EventAccumulator(directory)
    acc.Reload()
    tags = acc.Tags()
    if tag in tags.get("scalars", []):
        return [(e.step, round(e.value, 5)) for e in acc.Scalars(tag)]
    import tensorflow as tf  # tf.summary writes tensors, not simple values

    return [(e.step, round(float(tf.make_ndarray(e.tensor_proto)), 5)) for e in acc.Tensors(tag)]


def test_log_dir_from_contract(vertex_env):
    vertex_env(trial="3", base_output_dir="gs://bucket/base/")
    assert tensorboard.log_dir() == "gs://bucket/base/3/logs"


def test_log_dir_local_fallback(clean_env, tmp_path):
    assert tensorboard.log_dir() == str(tmp_path / "vertexrt_output" / "logs")


@pytest.mark.parametrize("backend", ["torch", "tf", "scalars"])
def test_writer_events_readable(storage_root, backend, tmp_path):
    pytest.importorskip({"torch": "torch", "tf": "tensorflow"}.get(backend, "vertexrt"))
    target = paths.join(storage_root, "run-1", "logs")
    with tensorboard.writer(target, backend=backend, chief_only=False) as tb:
        assert tb.enabled and tb.backend == backend
        for step in range(5):
            tb.scalars({"loss": 1.0 / (step + 1), "accuracy": step / 10}, step)
    if paths.is_gcs(target):
        assert tb.local_dir is not None and not os.path.exists(tb.local_dir)  # staging removed once uploaded
    else:
        assert tb.local_dir == target
    local = _download(target, tmp_path / "events")
    assert _scalars(local, "loss") == [(s, round(1.0 / (s + 1), 5)) for s in range(5)]
    assert _scalars(local, "accuracy") == [(s, round(s / 10, 5)) for s in range(5)]


def test_gcs_flush_uploads_before_close(gcs_server, tmp_path):
    pytest.importorskip("torch")
    target = f"gs://{gcs_server.bucket}/flush-test/logs"
    tb = tensorboard.writer(target, backend="torch", chief_only=False, upload_interval=3600)
    try:
        tb.scalar("loss", 0.5, 1)
        tb.flush()
        assert _scalars(_download(target, tmp_path / "first"), "loss") == [(1, 0.5)]
        tb.scalar("loss", 0.25, 2)
        tb.add_text("note", "native method of the wrapped writer", 2)  # delegated to torch's writer
    finally:
        tb.close()
    second = _download(target, tmp_path / "second")
    assert _scalars(second, "loss") == [(1, 0.5), (2, 0.25)]
    fs, path = paths.filesystem(target)
    assert tb.bytes_uploaded == sum(fs.size(p) for p in fs.find(path))  # appended, never re-sent whole
    assert "note/text_summary" in EventAccumulator(second).Reload().Tags()["tensors"]


def test_fuse_dir_is_staged_and_appended(monkeypatch, tmp_path):
    pytest.importorskip("torch")
    mount = tmp_path / "fuse"
    (mount / "bucket").mkdir(parents=True)
    monkeypatch.setenv("VERTEXRT_FUSE_ROOT", str(mount))  # a local directory stands in for the mount
    with tensorboard.writer("/gcs/bucket/run/logs", backend="torch", chief_only=False) as tb:
        assert tb.local_dir != "/gcs/bucket/run/logs"  # events are not appended through the mount
        tb.scalar("loss", 0.5, 1)
        tb.flush()
        tb.scalar("loss", 0.25, 2)
    written = mount / "bucket" / "run" / "logs"
    assert _scalars(str(written), "loss") == [(1, 0.5), (2, 0.25)]
    assert tb.bytes_uploaded == sum(f.stat().st_size for f in written.iterdir())


def test_gcs_background_upload(gcs_server, tmp_path):
    pytest.importorskip("torch")
    target = f"gs://{gcs_server.bucket}/periodic/logs"
    tb = tensorboard.writer(target, backend="torch", chief_only=False, upload_interval=0.05)
    try:
        tb.scalar("loss", 0.5, 1)
        fs, path = paths.filesystem(target)
        deadline = time.monotonic() + 30
        found: list[tuple[int, float]] = []
        while time.monotonic() < deadline and not found:
            fs.invalidate_cache()
            if fs.exists(path):
                found = _scalars(_download(target, tmp_path / f"poll{time.monotonic_ns()}"), "loss")
            time.sleep(0.05)
        assert found == [(1, 0.5)]  # arrived without flush() or close()
    finally:
        tb.close()


def test_non_chief_writes_nothing(monkeypatch, tmp_path):
    monkeypatch.setattr(hypertune, "is_chief", lambda: False)
    target = tmp_path / "logs"
    with tensorboard.writer(str(target)) as tb:
        assert not tb.enabled
        tb.scalar("loss", 1.0, 0)
        tb.add_histogram("w", [1, 2], 0)
        with tb.as_default():
            pass
        tb.flush()
    assert not target.exists()


def test_unknown_backend_is_a_config_error(tmp_path):
    with pytest.raises(ValueError, match="unknown backend 'mxnet'"):
        tensorboard.writer(str(tmp_path), backend="mxnet", chief_only=False)


def test_files_backend_uploads_what_another_writer_wrote_and_adds_no_run_of_its_own(storage_root):
    """Keras's TensorBoard callback writes the events; the files backend only stages and uploads them."""
    target = storage_root.rstrip("/") + "/files-backend"
    tb = writer(target, backend="files", chief_only=False)
    os.makedirs(os.path.join(tb.local_dir, "train"), exist_ok=True)
    with open(os.path.join(tb.local_dir, "train", "events.out.tfevents.1"), "wb") as f:
        f.write(b"written by another writer")
    with pytest.raises(ConfigError, match="no scalar"):
        tb.scalar("loss", 1.0, 0)
    tb.close()
    fs, path = paths.filesystem(target)
    names = sorted(p.rsplit("/", 1)[-1] for p in fs.find(path))
    assert names == ["events.out.tfevents.1"]  # nothing in the root: no empty run "."


def test_a_delta_whose_cleanup_failed_is_not_appended_twice(gcs_server, fault_proxy):
    # The delta was composed onto the object, then deleting the delta object failed: the upload was not
    # recorded, and the next sync appended the same events again (duplicated steps in TensorBoard).
    target = f"gs://{gcs_server.bucket}/tb-cleanup-{uuid.uuid4().hex}/logs"
    tb = writer(target, backend="files", chief_only=False, upload_interval=3600)
    events = os.path.join(tb.local_dir, "events.out.tfevents.1")
    with open(events, "wb") as f:
        f.write(b"A" * 10)
    tb.flush()
    with open(events, "ab") as f:
        f.write(b"B" * 10)
    fault_proxy.set("cut", match=r"^DELETE [^\r\n]*vertexrt-part")  # the delete happens, its answer is lost
    with contextlib.suppress(OSError):
        tb.flush()
    fault_proxy.set("pass")
    tb.close()
    fs, path = paths.filesystem(target)
    fs.invalidate_cache()
    assert fs.cat_file(f"{path}/events.out.tfevents.1") == b"A" * 10 + b"B" * 10


def test_a_compose_whose_answer_was_lost_is_not_appended_twice(gcs_server, fault_proxy):
    # The compose of B landed but its answer was lost; by the retry the writer had added C. The retry
    # compared the object's size with the grown delta and appended B a second time.
    target = f"gs://{gcs_server.bucket}/tb-compose-{uuid.uuid4().hex}/logs"
    tb = writer(target, backend="files", chief_only=False, upload_interval=3600)
    events = os.path.join(tb.local_dir, "events.out.tfevents.1")
    for chunk in (b"A", b"B", b"C"):
        with open(events, "ab") as f:
            f.write(chunk * 10)
        if chunk == b"B":
            fault_proxy.set("cut", count=1, match=r"^POST [^\r\n]*/compose")  # composed, the answer is lost
        with contextlib.suppress(Exception):
            tb.flush()
    tb.close()
    assert fault_proxy.handled["cut"] == 1
    fs, path = paths.filesystem(target)
    fs.invalidate_cache()
    assert fs.cat_file(f"{path}/events.out.tfevents.1") == b"A" * 10 + b"B" * 10 + b"C" * 10

"""Vertex managed-dataset exports: JSONL lines naming objects, fetched in parallel, labels as stable ids."""

from __future__ import annotations

import json
import uuid
from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest

from vertexrt import paths
from vertexrt.data import open_dataset
from vertexrt.data.formats.base import FileSource
from vertexrt.data.formats.managed import VertexImage, VertexText, VertexVideo, format_for_line, sniff
from vertexrt.errors import DataError

from .conftest import write_bytes

NAMES = ["zebra", "cat", "dog"]
TEST_BUCKET = "vertexrt-test"  # the GCS server's bucket (tests/conftest.py)


@pytest.fixture
def fuse(tmp_path, monkeypatch: pytest.MonkeyPatch) -> str:
    """``/gcs/vertexrt-test``, a bucket on a local mirror of the Cloud Storage FUSE mount."""
    (tmp_path / "fuse" / TEST_BUCKET).mkdir(parents=True)
    monkeypatch.setenv("VERTEXRT_FUSE_ROOT", str(tmp_path / "fuse"))
    return f"/gcs/{TEST_BUCKET}"


@pytest.fixture(params=["fuse", "gcs"])
def object_root(request: pytest.FixtureRequest, fuse: str) -> str:
    """Where a test's objects and export live: the FUSE mount, or a bucket on the GCS server."""
    if request.param == "fuse":
        return fuse
    request.getfixturevalue("gcs_server")
    return f"gs://{TEST_BUCKET}/{uuid.uuid4().hex}"


def image_export(root: str, write_jsonl: Callable[..., str], n: int = 150, files: int = 3) -> dict[str, Any]:
    """``n`` images under ``root/img`` and an export ``root/export/training-*.jsonl`` naming them."""
    images: dict[str, tuple[bytes, str]] = {}
    lines = []
    for i in range(n):
        uri = paths.join(root, f"img/{i:04d}.jpg")
        name = NAMES[0] if i >= n - 5 else NAMES[1 + i % 2]  # zebra only in the last file
        images[uri] = (f"\xff\xd8 image {i}".encode() + bytes(i % 50), name)
        write_bytes(uri, images[uri][0])
        lines.append(
            {
                "imageGcsUri": uri,
                "classificationAnnotation": {
                    "displayName": name,
                    "annotationResourceLabels": {"aiplatform.googleapis.com/annotation_set_name": "80667"},
                },
                "dataItemResourceLabels": {},
            }
        )
    per = -(-n // files)
    for f in range(files):
        write_jsonl(
            paths.join(root, f"export/training-{f:05d}-of-{files:05d}.jsonl"), lines[f * per : (f + 1) * per]
        )
    return images


def test_image_export_yields_fetched_bytes_and_sorted_label_ids(object_root: str, write_jsonl) -> None:
    images = image_export(object_root, write_jsonl)
    ds = open_dataset(
        paths.join(object_root, "export/training-*"), format=VertexImage(), seed=3, rank=0, world_size=1
    )
    assert ds.format.classes == ["cat", "dog", "zebra"]
    records = list(ds)
    assert sorted(r["path"] for r in records) == sorted(images)
    for record in records:
        data, name = images[record["path"]]
        assert record["bytes"] == data
        assert ds.format.classes[record["label"]] == name and record["labels"] == [record["label"]]
    assert [r["path"] for r in records] != sorted(images)  # shuffled


def test_every_rank_maps_names_to_the_same_ids(fuse: str, write_jsonl) -> None:
    images = image_export(fuse, write_jsonl)
    seen: Counter[str] = Counter()
    for rank in range(3):  # rank shares hold different classes; ids come from all the files
        ds = open_dataset(
            f"{fuse}/export/*.jsonl", format=VertexImage(), rank=rank, world_size=3, equalize=None
        )
        for record in ds:
            seen[record["path"]] += 1
            assert ["cat", "dog", "zebra"][record["label"]] == images[record["path"]][1]
    assert len(seen) == len(images) and set(seen.values()) == {1}


def test_resume_mid_epoch_continues_with_the_next_record(object_root: str, write_jsonl) -> None:
    image_export(object_root, write_jsonl, n=90)
    pattern = paths.join(object_root, "export/*.jsonl")

    def fresh() -> Any:
        return open_dataset(pattern, format=VertexImage(), seed=5, shuffle_buffer=16, rank=0, world_size=1)

    full = [r["path"] for r in fresh()]
    for stop in (1, 40, 89):
        ds = fresh()
        it = iter(ds)
        head = [next(it)["path"] for _ in range(stop)]
        state = json.loads(json.dumps(ds.state_dict()))
        again = fresh()
        again.load_state_dict(state)
        assert head + [r["path"] for r in again] == full


def test_a_missing_object_raises_naming_it_or_is_skipped_and_counted(object_root: str, write_jsonl) -> None:
    images = image_export(object_root, write_jsonl, n=30, files=1)
    gone = sorted(images)[7]
    fs, path = paths.filesystem(gone)
    fs.rm(path)
    pattern = paths.join(object_root, "export/*.jsonl")
    with pytest.raises(
        DataError, match=r"training-00000-of-00001.jsonl:8 .*0007.jpg: referenced object not found"
    ):
        list(open_dataset(pattern, format=VertexImage(), shuffle=False, rank=0, world_size=1))
    ds = open_dataset(pattern, format=VertexImage(), on_error="skip", rank=0, world_size=1)
    assert sorted(r["path"] for r in ds) == sorted(set(images) - {gone})
    assert ds.skipped == 1


def test_detection_boxes_multi_label_text_and_video_segments(fuse: str, write_jsonl) -> None:
    root = fuse
    write_bytes(f"{root}/a.jpg", b"A")
    write_bytes(f"{root}/t.txt", "héllo".encode())
    write_bytes(f"{root}/v.mp4", b"V" * 10)
    write_jsonl(
        f"{root}/img.jsonl",
        [
            {
                "imageGcsUri": f"{root}/a.jpg",
                "boundingBoxAnnotations": [
                    {"displayName": "dog", "xMin": 0.1, "yMin": 0.2, "xMax": 0.5, "yMax": 0.9},
                    {"displayName": "cat", "xMin": 0, "yMin": 0, "xMax": 1, "yMax": 1},
                ],
                "classificationAnnotations": [{"displayName": "pets"}, {"displayName": "indoor"}],
            }
        ],
    )
    [image] = list(open_dataset(f"{root}/img.jsonl", format=VertexImage(), rank=0, world_size=1))
    assert image["bytes"] == b"A" and image["label"] is None
    assert image["boxes"] == [[0.1, 0.2, 0.5, 0.9], [0.0, 0.0, 1.0, 1.0]]
    classes = ["cat", "dog", "indoor", "pets"]
    assert image["box_labels"] == [1, 0] and image["labels"] == [3, 2]

    write_jsonl(
        f"{root}/text.jsonl",
        [
            {"textContent": "inline", "classificationAnnotation": {"displayName": "pos"}},
            {"textGcsUri": f"{root}/t.txt", "classificationAnnotation": {"displayName": "neg"}},
        ],
    )
    texts = list(open_dataset(f"{root}/text.jsonl", format=VertexText(), shuffle=False, rank=0, world_size=1))
    assert [(t["text"], t["label"]) for t in texts] == [("inline", 1), ("héllo", 0)]

    write_jsonl(
        f"{root}/video.jsonl",
        [
            {
                "videoGcsUri": f"{root}/v.mp4",
                "timeSegmentAnnotations": [{"displayName": "run", "startTime": "1.5s", "endTime": "3s"}],
            }
        ],
    )
    [video] = list(open_dataset(f"{root}/video.jsonl", format=VertexVideo(), rank=0, world_size=1))
    assert (
        video["bytes"] == b"V" * 10 and video["segments"] == [[1.5, 3.0]] and video["segment_labels"] == [0]
    )
    [bare] = list(open_dataset(f"{root}/video.jsonl", format=VertexVideo(fetch=False), rank=0, world_size=1))
    assert bare["bytes"] is None and bare["path"] == f"{root}/v.mp4"
    assert classes  # the ids above index the sorted display names


def test_a_name_outside_given_classes_is_a_bad_record(fuse: str, write_jsonl) -> None:
    image_export(fuse, write_jsonl, n=20, files=1)
    ds = open_dataset(f"{fuse}/export/*.jsonl", format=VertexImage(classes=["cat"]), rank=0, world_size=1)
    with pytest.raises(DataError, match=r"label 'dog' is not one of the classes \['cat'\]"):
        list(ds)


def test_the_export_kind_is_told_from_its_first_line(fuse: str, write_jsonl) -> None:
    image_export(fuse, write_jsonl, n=4, files=1)
    [uri] = open_dataset(f"{fuse}/export/*.jsonl", format="jsonl").files
    assert isinstance(sniff([FileSource(uri, 1)]), VertexImage)
    assert isinstance(format_for_line({"textContent": "x"}), VertexText)
    assert isinstance(format_for_line({"videoGcsUri": "gs://b/v.mp4"}), VertexVideo)
    assert format_for_line({"id": 1}) is None


def test_transient_storage_faults_are_retried(gcs_server, fault_proxy, write_jsonl) -> None:
    root = f"gs://{gcs_server.bucket}/retry"
    images = image_export(root, write_jsonl, n=12, files=1)
    target = sorted(images)[3].split("/", 3)[3].replace("/", "%2F")
    fault_proxy.set("reset", count=3, match=target)  # the object's first three reads are cut off
    ds = open_dataset(f"{root}/export/*.jsonl", format=VertexImage(), rank=0, world_size=1)
    assert {r["path"]: r["bytes"] for r in ds} == {uri: data for uri, (data, _) in images.items()}
    assert fault_proxy.handled["reset"] == 3


def test_a_batch_mixing_cloud_storage_and_local_objects_keeps_line_order(
    gcs_server, fuse: str, tmp_path, write_jsonl
) -> None:
    remote = image_export(f"gs://{gcs_server.bucket}/mixed", write_jsonl, n=70, files=1)
    local = image_export(fuse, write_jsonl, n=70, files=1)
    gone = [sorted(remote)[5], sorted(local)[60]]
    for uri in gone:
        fs, path = paths.filesystem(uri)
        fs.rm(path)
    uris = [uri for pair in zip(sorted(remote), sorted(local), strict=True) for uri in pair]  # alternating
    write_jsonl(f"{tmp_path}/mixed.jsonl", [{"imageGcsUri": uri} for uri in uris])
    ds = open_dataset(
        f"{tmp_path}/mixed.jsonl",
        format=VertexImage(concurrency=3, ahead=1),
        shuffle=False,
        on_error="skip",
        rank=0,
        world_size=1,
    )
    images = {**remote, **local}
    assert [(r["path"], r["bytes"]) for r in ds] == [(u, images[u][0]) for u in uris if u not in gone]
    assert ds.skipped == 2


def test_an_object_over_max_record_bytes_is_a_bad_record(object_root: str, write_jsonl) -> None:
    images = image_export(object_root, write_jsonl, n=6, files=1)
    big = sorted(images)[2]
    write_bytes(big, b"x" * 2000)  # the lines are shorter than the limit
    ds = open_dataset(
        paths.join(object_root, "export/*.jsonl"),
        format=VertexImage(max_record_bytes=1000),
        on_error="skip",
        rank=0,
        world_size=1,
    )
    assert sorted(r["path"] for r in ds) == sorted(set(images) - {big}) and ds.skipped == 1
    with pytest.raises(DataError, match=r"0002.jpg: the object is larger than max_record_bytes=1000"):
        list(
            open_dataset(paths.join(object_root, "export/*.jsonl"), format=VertexImage(max_record_bytes=1000))
        )


# -- hostile exports: object URIs that are not Cloud Storage objects are never read ----------------------


@pytest.fixture
def http_server() -> Any:
    """A loopback HTTP server that records every request it receives."""
    import http.server
    import threading

    received: list[str] = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - the stdlib's name
            received.append(self.path)
            self.send_response(200)
            self.end_headers()
            self.wfile.write(b"secret from the network")

        def log_message(self, *args: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    server.received = received  # type: ignore[attr-defined]
    yield server
    server.shutdown()
    server.server_close()


def test_object_uris_other_than_cloud_storage_are_refused_and_never_read(
    fuse: str, tmp_path, http_server, write_jsonl
) -> None:
    secret = tmp_path / "secret.txt"
    secret.write_bytes(b"local secret")
    port = http_server.server_address[1]
    write_bytes(f"{fuse}/ok.jpg", b"OK")
    hostile = [
        str(secret),
        f"file://{secret}",
        "/proc/self/environ",
        f"http://127.0.0.1:{port}/x.jpg",
        f"https://127.0.0.1:{port}/x.jpg",
        f"ftp://127.0.0.1:{port}/x.jpg",
        f"{fuse}/../../{tmp_path.name}/secret.txt",
        "gs://vertexrt-test",
        "gs:/vertexrt-test/x.jpg",
    ]
    lines = [{"imageGcsUri": f"{fuse}/ok.jpg"}] + [{"imageGcsUri": uri} for uri in hostile]
    export = write_jsonl(f"{tmp_path}/export.jsonl", lines)
    with pytest.raises(DataError, match=r"export.jsonl:2 .*imageGcsUri=.*secret.txt.* refused"):
        list(open_dataset(export, format=VertexImage(), shuffle=False, rank=0, world_size=1))
    ds = open_dataset(export, format=VertexImage(), shuffle=False, on_error="skip", rank=0, world_size=1)
    assert [(r["path"], r["bytes"]) for r in ds] == [(f"{fuse}/ok.jpg", b"OK")]
    assert ds.skipped == len(hostile)
    text = write_jsonl(f"{tmp_path}/text.jsonl", [{"textGcsUri": f"http://127.0.0.1:{port}/t.txt"}])
    with pytest.raises(DataError, match=r"text.jsonl:1 .*textGcsUri='http://127.0.0.1"):
        list(open_dataset(text, format=VertexText(), rank=0, world_size=1))
    bare = open_dataset(export, format=VertexImage(fetch=False), on_error="skip", rank=0, world_size=1)
    assert [r["path"] for r in bare] == [f"{fuse}/ok.jpg"] and bare.skipped == len(hostile)
    assert http_server.received == []


# -- objects that never answer: a FIFO, a stalled Cloud Storage read ----------------------------------------


def test_a_fifo_object_is_refused_not_waited_on(fuse: str, tmp_path, write_jsonl) -> None:
    import os

    write_bytes(f"{fuse}/a.jpg", b"A")
    os.mkfifo(tmp_path / "fuse" / TEST_BUCKET / "fifo.jpg")  # no writer: opening it to read would block
    export = write_jsonl(
        f"{tmp_path}/export.jsonl", [{"imageGcsUri": f"{fuse}/fifo.jpg"}, {"imageGcsUri": f"{fuse}/a.jpg"}]
    )
    with pytest.raises(DataError, match=r"export.jsonl:1 .*fifo.jpg is not a regular file"):
        list(open_dataset(export, format=VertexImage(), shuffle=False, rank=0, world_size=1))
    ds = open_dataset(export, format=VertexImage(), on_error="skip", rank=0, world_size=1)
    assert [r["bytes"] for r in ds] == [b"A"] and ds.skipped == 1


@pytest.mark.timeout(60)
def test_a_stalled_object_ends_by_the_storage_deadline(
    gcs_server, fault_proxy, monkeypatch: pytest.MonkeyPatch, tmp_path, write_jsonl
) -> None:
    root = f"gs://{gcs_server.bucket}/{uuid.uuid4().hex}"
    images = image_export(root, write_jsonl, n=6, files=1)
    stalled = sorted(images)[2]
    export = write_jsonl(f"{tmp_path}/export.jsonl", [{"imageGcsUri": uri} for uri in sorted(images)])
    monkeypatch.setenv("VERTEXRT_STORAGE_TIMEOUT", "1")
    fault_proxy.set("stall", match=stalled.split("/", 3)[3].replace("/", "%2F"))  # that object's reads only
    ds = open_dataset(export, format=VertexImage(), shuffle=False, on_error="skip", rank=0, world_size=1)
    assert [r["path"] for r in ds] == [u for u in sorted(images) if u != stalled] and ds.skipped == 1
    with pytest.raises(
        DataError, match=r"export.jsonl:3 .*0002.jpg: Cloud Storage got no usable answer within 1 s"
    ) as exc:
        list(open_dataset(export, format=VertexImage(), shuffle=False, rank=0, world_size=1))
    assert "VERTEXRT_STORAGE_TIMEOUT" in str(exc.value)
    assert fault_proxy.handled["stall"] >= 2


# -- fetched bytes are bounded, not only the count of objects -------------------------------------------


def test_fetched_objects_held_ahead_are_bounded_in_bytes(fuse: str, tmp_path, write_jsonl) -> None:
    import tracemalloc

    size, n = 1 << 20, 120
    for i in range(n):
        write_bytes(f"{fuse}/big/{i:03d}.mp4", bytes([i]) * size)
    export = write_jsonl(
        f"{tmp_path}/export.jsonl", [{"videoGcsUri": f"{fuse}/big/{i:03d}.mp4"} for i in range(n)]
    )
    ds = open_dataset(
        export,
        format=VertexVideo(concurrency=4, max_bytes_ahead=8 * size),
        shuffle=False,
        rank=0,
        world_size=1,
    )
    tracemalloc.start()
    try:
        seen = 0
        for record in ds:
            assert record["bytes"][:1] == bytes([seen]) and len(record["bytes"]) == size
            seen += 1
            del record
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert seen == n
    # the budget, the objects in flight past it and the batch being consumed; before, every one (120 MiB)
    assert peak < 24 * size, f"peak {peak / size:.1f} MiB held"

"""Binary files (images, audio): one record per object, ``class/name.jpg`` labels, sharding and resume."""

from __future__ import annotations

import json
from collections import Counter

import pytest

from vertexrt import paths
from vertexrt.data import Files, open_dataset
from vertexrt.errors import DataError

from .conftest import write_bytes

CLASSES = {"cat": 5, "dog": 3, "zebra": 4}  # 12 images


def image_tree(root: str) -> dict[str, bytes]:
    """``root/images/<class>/<i>.jpg`` with distinct contents; returns uri -> bytes."""
    made = {}
    for name, count in CLASSES.items():
        for i in range(count):
            uri = paths.join(root, f"images/{name}/{i:03d}.jpg")
            made[uri] = f"\xff\xd8 {name} {i}".encode() + bytes(range(i))
            write_bytes(uri, made[uri])
    return made


def test_images_by_class_directory_are_detected_and_labelled(storage_root: str) -> None:
    made = image_tree(storage_root)
    ds = open_dataset(paths.join(storage_root, "images/*/*.jpg"), seed=1, rank=0, world_size=1)
    assert isinstance(ds.format, Files) and ds.format.classes == ["cat", "dog", "zebra"]
    records = list(ds)
    assert sorted(r["path"] for r in records) == sorted(made)
    for record in records:
        assert record["bytes"] == made[record["path"]]
        assert record["label"] == ds.format.classes.index(record["path"].split("/")[-2])
    assert [r["path"] for r in records] != sorted(made)  # shuffled
    explicit = open_dataset(
        paths.join(storage_root, "images"), format="files", shuffle=False, world_size=1, rank=0
    )
    assert [r["path"] for r in explicit] == sorted(made)


def test_every_rank_reads_its_share_once_with_the_same_label_ids(storage_root: str) -> None:
    image_tree(storage_root)
    seen: Counter[str] = Counter()
    for rank in range(3):
        # rank 2 sees only the dog and zebra images, and still maps them to the ids rank 0 uses
        ds = open_dataset(paths.join(storage_root, "images/*/*.jpg"), rank=rank, world_size=3, equalize=None)
        for record in ds:
            seen[record["path"]] += 1
            assert ds.format.classes[record["label"]] == record["path"].split("/")[-2]
    assert len(seen) == 12 and set(seen.values()) == {1}


def test_resume_continues_with_the_next_file(tmp_path) -> None:
    image_tree(str(tmp_path))
    pattern = f"{tmp_path}/images/*/*.jpg"
    full = [r["path"] for r in open_dataset(pattern, seed=4, rank=0, world_size=1)]
    for stop in (0, 1, 7, 12):
        ds = open_dataset(pattern, seed=4, rank=0, world_size=1)
        it = iter(ds)
        head = [next(it)["path"] for _ in range(stop)]
        state = json.loads(json.dumps(ds.state_dict()))
        again = open_dataset(pattern, seed=4, rank=0, world_size=1)
        again.load_state_dict(state)
        assert head + [r["path"] for r in again] == full


def test_a_file_outside_the_named_classes_is_a_bad_record(tmp_path) -> None:
    image_tree(str(tmp_path))
    ds = open_dataset(
        f"{tmp_path}/images/*/*.jpg", format=Files(classes=["cat", "dog"]), rank=0, world_size=1
    )
    with pytest.raises(DataError, match=r"zebra/00\d.jpg.*not one of the classes \['cat', 'dog'\]"):
        list(ds)
    skipping = open_dataset(
        f"{tmp_path}/images/*/*.jpg",
        format=Files(classes=["cat", "dog"]),
        on_error="skip",
        rank=0,
        world_size=1,
    )
    assert len(list(skipping)) == 8 and skipping.skipped == 4


def test_an_oversized_file_is_refused_before_it_is_read(tmp_path) -> None:
    image_tree(str(tmp_path))
    ds = open_dataset(
        f"{tmp_path}/images/*/*.jpg", format=Files(max_record_bytes=12), rank=0, world_size=1, on_error="skip"
    )
    assert all(len(r["bytes"]) <= 12 for r in ds) and ds.skipped > 0

"""gs:// <-> /gcs/ translation, validation, and one opener over local disk, FUSE and the GCS server."""

from __future__ import annotations

import os

import pytest

from vertexrt import paths
from vertexrt.errors import PathError


@pytest.mark.parametrize(
    ("uri", "fuse"),
    [
        ("gs://b12/o", "/gcs/b12/o"),
        ("gs://my-bucket/a/b/c.txt", "/gcs/my-bucket/a/b/c.txt"),
        ("gs://my-bucket", "/gcs/my-bucket"),
        ("gs://my.bucket_1/dir/", "/gcs/my.bucket_1/dir/"),
        ("gs://bkt/with space/ünïcode #1?.txt", "/gcs/bkt/with space/ünïcode #1?.txt"),
    ],
)
def test_round_trip(uri, fuse):
    assert paths.to_fuse(uri) == fuse
    assert paths.to_gcs(fuse) == uri
    assert paths.is_gcs(uri) and paths.is_fuse(fuse)
    assert not paths.is_gcs(fuse) and not paths.is_fuse(uri)


@pytest.mark.parametrize(
    ("bad", "named"),
    [
        ("gs://", "no bucket"),
        ("gs:///object", "no bucket"),
        ("gs://UpperCase/x", "lowercase"),
        ("gs://a..b/x", r"\.\."),
        ("gs://" + "a" * 64 + "/x", "63"),
        ("gs://ab/x", "3-63"),
        ("gs://-abc/x", "starting and ending"),
        ("gs://192.168.1.1/x", "IP"),
        ("gs://google-data/x", "google"),
        ("gs://b12/../x", r"'\.\.' segment"),
        ("gs://b12/a/./x", r"'\.' or"),
        ("gs://b12/a\nb", "line feeds"),
    ],
)
def test_invalid_gcs_uris_name_the_input(bad, named):
    with pytest.raises(PathError, match=named) as info:
        paths.to_fuse(bad)
    assert repr(bad)[1:12] in str(info.value) or "bucket" in str(info.value)


@pytest.mark.parametrize("bad", ["/gcs/", "/gcs//obj", "/gcs/Bad/x", "/gcs/b12/../etc"])
def test_invalid_fuse_paths(bad):
    with pytest.raises(PathError):
        paths.to_gcs(bad)


def test_not_a_uri():
    with pytest.raises(PathError, match="not a /gcs/ path"):
        paths.to_gcs("/tmp/x")
    with pytest.raises(PathError, match="not a gs:// URI"):
        paths.split_gcs("s3://x/y")
    with pytest.raises(PathError, match="empty string"):
        paths.filesystem("")


def test_long_object_name_refused():
    with pytest.raises(PathError, match="1024 bytes"):
        paths.split_gcs("gs://b12/" + "é" * 600)


@pytest.mark.parametrize(
    ("base", "parts", "joined"),
    [
        ("gs://b12/base/", ("3", "model"), "gs://b12/base/3/model"),
        ("gs://b12", ("x",), "gs://b12/x"),
        ("/gcs/b12/base", ("/ckpt/",), "/gcs/b12/base/ckpt"),
        ("/tmp/run/", ("a", "b.txt"), "/tmp/run/a/b.txt"),
        ("/", ("etc",), "/etc"),
    ],
)
def test_join(base, parts, joined):
    assert paths.join(base, *parts) == joined


def test_join_refuses_an_empty_base():
    with pytest.raises(PathError, match="empty string"):
        paths.join("", "x")


def test_join_refuses_escaping_a_bucket():
    with pytest.raises(PathError):
        paths.join("gs://b12/base", "..", "other")


def test_storage_kind():
    assert paths.storage_kind("gs://b12/x") == "gcs"
    assert paths.storage_kind("/gcs/b12/x") == "fuse"
    assert paths.storage_kind("/tmp/x") == "local"
    assert paths.storage_kind("relative/dir") == "local"


def test_open_write_read_list(storage_root):
    target = paths.join(storage_root, "dir with space", "ünï #1?.txt")
    with paths.open(target, "w") as handle:
        handle.write("hello")
    with paths.open(target) as handle:
        assert handle.read() == b"hello"
    fs, path = paths.filesystem(paths.join(storage_root, "dir with space"))
    names = [os.path.basename(p.rstrip("/")) for p in fs.ls(path)]
    assert names == ["ünï #1?.txt"]


def test_open_large_write_with_block_size(storage_root):
    payload = os.urandom(3 << 20)
    target = paths.join(storage_root, "big.bin")
    with paths.open(target, "wb", block_size=1 << 20) as handle:
        handle.write(payload)
    with paths.open(target, "rb") as handle:
        assert handle.read() == payload


def test_open_bucket_without_object_is_refused(gcs_server):
    with pytest.raises(PathError, match="names a bucket"):
        paths.open(f"gs://{gcs_server.bucket}/", "w")
    with pytest.raises(PathError, match="names a bucket"):
        paths.open("/gcs/some-bucket", "rb")


def test_fuse_path_uses_mount_when_bucket_is_mounted(gcs_server, monkeypatch, tmp_path):
    monkeypatch.setenv("VERTEXRT_FUSE_ROOT", str(tmp_path / "mnt"))
    (tmp_path / "mnt" / "mounted-bucket").mkdir(parents=True)
    with paths.open("/gcs/mounted-bucket/a/b.txt", "w") as handle:
        handle.write("via mount")
    assert (tmp_path / "mnt" / "mounted-bucket" / "a" / "b.txt").read_text() == "via mount"
    # gs:// goes to the API unless the caller prefers the mount
    fs, _ = paths.filesystem("gs://mounted-bucket/a/b.txt")
    assert "gs" in fs.protocol
    fs, path = paths.filesystem("gs://mounted-bucket/a/b.txt", prefer_fuse=True)
    assert path == str(tmp_path / "mnt" / "mounted-bucket" / "a" / "b.txt")


def test_fuse_path_without_mount_goes_through_the_api(gcs_server, monkeypatch, tmp_path):
    monkeypatch.setenv("VERTEXRT_FUSE_ROOT", str(tmp_path / "no-mount"))
    fuse = f"/gcs/{gcs_server.bucket}/fuse-fallback/x.txt"
    with paths.open(fuse, "w") as handle:
        handle.write("via api")
    with paths.open(paths.to_gcs(fuse)) as handle:
        assert handle.read() == b"via api"


def test_missing_file_is_a_clear_error(storage_root):
    with pytest.raises(FileNotFoundError):
        paths.open(paths.join(storage_root, "missing.txt")).read()


def test_emulator_switch_set_for_users(gcs_server, monkeypatch):
    monkeypatch.delenv("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", raising=False)
    fs = paths.gcs_filesystem()
    assert os.environ["GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT"] == "false"
    assert type(fs).__module__ == "gcsfs.core"

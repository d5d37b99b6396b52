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


# -- no escape from a bucket or the mount -------------------------------------------------------------


@pytest.mark.parametrize(
    "bad",
    [
        "/gcs/bkt-1//etc/passwd",
        "gs://bkt-1//etc/passwd",
        "gs://bkt-1/a//b",
        "/gcs/bkt-1/a\x00b",
        "gs://bkt-1/a\x00b",
        "gs:/bkt-1/x",
        "gs:bkt-1/x",
        "GS://bkt-1/x",
    ],
)
def test_uris_that_would_escape_or_are_malformed_are_refused(bad, monkeypatch, tmp_path):
    monkeypatch.setenv("VERTEXRT_FUSE_ROOT", str(tmp_path / "mnt"))
    (tmp_path / "mnt" / "bkt-1").mkdir(parents=True)
    with pytest.raises(PathError):
        paths.filesystem(bad, prefer_fuse=True)
    with pytest.raises(PathError):
        paths.storage_kind(bad)


def test_fuse_read_and_write_stay_inside_the_mount(monkeypatch, tmp_path):
    secret = tmp_path / "host" / "secret.txt"
    secret.parent.mkdir()
    secret.write_text("host file")
    monkeypatch.setenv("VERTEXRT_FUSE_ROOT", str(tmp_path / "mnt"))
    (tmp_path / "mnt" / "bkt-1").mkdir(parents=True)
    for uri in (f"/gcs/bkt-1/{secret}", f"gs://bkt-1/{secret}"):
        with pytest.raises(PathError, match="empty segment"):
            paths.open(uri, "rb", prefer_fuse=True)
        with pytest.raises(PathError, match="empty segment"):
            paths.open(uri.replace("secret.txt", "new.txt"), "w", prefer_fuse=True)
    assert not (tmp_path / "host" / "new.txt").exists()


def test_symlink_out_of_the_mounted_bucket_is_refused(monkeypatch, tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    monkeypatch.setenv("VERTEXRT_FUSE_ROOT", str(tmp_path / "mnt"))
    (tmp_path / "mnt" / "bkt-1").mkdir(parents=True)
    (tmp_path / "mnt" / "bkt-1" / "link").symlink_to(outside)
    with pytest.raises(PathError, match="outside"):
        paths.open("/gcs/bkt-1/link/x.txt", "w")
    assert not (outside / "x.txt").exists()


def test_nul_byte_in_a_local_path_is_a_path_error(tmp_path):
    with pytest.raises(PathError, match="NUL"):
        paths.open(f"{tmp_path}/a\x00b", "w")


@pytest.mark.parametrize(
    ("uri", "shown"),
    [
        ("gs://user:secret@bkt-1/x", "gs://***@bkt-1/x"),
        (
            "https://storage.googleapis.com/b/o?X-Goog-Algorithm=A&X-Goog-Signature=abc123&x=1",
            "https://storage.googleapis.com/b/o?X-Goog-Algorithm=A&X-Goog-Signature=***&x=1",
        ),
        ("https://h/o?token=t0k&sig=s1g&alt=media", "https://h/o?token=***&sig=***&alt=media"),
        ("gs://bkt-1/plain/path", "gs://bkt-1/plain/path"),
        ("/local/path", "/local/path"),
    ],
)
def test_redact_masks_credentials(uri, shown):
    assert paths.redact(uri) == shown


def test_empty_segment_refused_before_reaching_the_server(gcs_server):
    bucket = gcs_server.bucket
    with pytest.raises(PathError, match="empty segment"):
        paths.open(f"gs://{bucket}//escape/x.txt", "w")
    fs, root = paths.filesystem(f"gs://{bucket}")
    fs.invalidate_cache()
    assert not any("escape" in name for name in fs.find(root))


# -- directory upload / download ----------------------------------------------------------------------


def _tree(root, files: dict[str, bytes]) -> None:
    for name, data in files.items():
        target = root / name
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(data)


_FILES = {
    "config.json": b"{}",
    "weights/part-0.bin": os.urandom(1 << 20),
    "weights/part-1.bin": b"",
    "deep/a/b/c/ünï #1.txt": b"unicode",
}


def _read_tree(root) -> dict[str, bytes]:
    return {
        os.path.relpath(os.path.join(d, f), root): open(os.path.join(d, f), "rb").read()  # noqa: SIM115
        for d, _, files in os.walk(root)
        for f in files
    }


def test_upload_then_download_round_trip(storage_root, tmp_path):
    _tree(tmp_path / "src", _FILES)
    remote = paths.join(storage_root, "tree")
    written = paths.upload(str(tmp_path / "src"), remote, workers=4)
    assert written == sorted(paths.join(remote, name) for name in _FILES)
    got = paths.download(remote, str(tmp_path / "dst"), workers=4)
    assert len(got) == len(_FILES)
    assert _read_tree(tmp_path / "dst") == _FILES


def test_upload_to_an_unmounted_fuse_path_goes_through_the_api(gcs_server, monkeypatch, tmp_path):
    monkeypatch.setenv("VERTEXRT_FUSE_ROOT", str(tmp_path / "no-mount"))
    _tree(tmp_path / "src", _FILES)
    fuse = f"/gcs/{gcs_server.bucket}/upload-fuse"
    paths.upload(str(tmp_path / "src"), fuse)
    paths.download(paths.to_gcs(fuse), str(tmp_path / "dst"))
    assert _read_tree(tmp_path / "dst") == _FILES


def test_upload_to_a_mounted_bucket(monkeypatch, tmp_path):
    monkeypatch.setenv("VERTEXRT_FUSE_ROOT", str(tmp_path / "mnt"))
    (tmp_path / "mnt" / "bkt-1").mkdir(parents=True)
    _tree(tmp_path / "src", _FILES)
    paths.upload(str(tmp_path / "src"), "/gcs/bkt-1/run")
    assert _read_tree(tmp_path / "mnt" / "bkt-1" / "run") == _FILES


def test_upload_refuses_a_symlink_leading_out(tmp_path):
    (tmp_path / "secret.txt").write_text("host file")
    _tree(tmp_path / "src", {"a.txt": b"a"})
    (tmp_path / "src" / "leak.txt").symlink_to(tmp_path / "secret.txt")
    with pytest.raises(PathError, match="outside"):
        paths.upload(str(tmp_path / "src"), str(tmp_path / "dst"))
    assert not (tmp_path / "dst").exists()


def test_download_refuses_object_names_that_escape(gcs_server, tmp_path):
    import gcsfs

    bucket = gcs_server.bucket
    fs = gcsfs.GCSFileSystem(endpoint_url=gcs_server.endpoint, token="anon")
    fs.pipe(f"{bucket}/escape-test/ok.txt", b"ok")
    fs.pipe(f"{bucket}/escape-test/a/../../../evil.txt", b"evil")  # a name Cloud Storage accepts as is
    fs.invalidate_cache()
    assert any(".." in key for key in fs.find(f"{bucket}/escape-test"))
    with pytest.raises(PathError, match=r"'\.\.'"):
        paths.download(f"gs://{bucket}/escape-test", str(tmp_path / "dst"))
    assert not (tmp_path / "evil.txt").exists() and not (tmp_path / "dst").exists()


def test_download_refuses_a_symlink_in_the_destination(tmp_path):
    _tree(tmp_path / "src", {"sub/x.txt": b"x"})
    (tmp_path / "dst").mkdir()
    (tmp_path / "outside").mkdir()
    (tmp_path / "dst" / "sub").symlink_to(tmp_path / "outside")
    with pytest.raises(PathError, match="outside the destination"):
        paths.download(str(tmp_path / "src"), str(tmp_path / "dst"))
    assert not list((tmp_path / "outside").iterdir())


def test_copy_of_a_missing_directory_names_it(storage_root, tmp_path):
    missing = paths.join(storage_root, "missing")
    with pytest.raises(PathError, match="missing"):
        paths.download(missing, str(tmp_path / "dst"))
    with pytest.raises(PathError, match="is not a directory"):
        paths.upload(str(tmp_path / "nope"), missing)

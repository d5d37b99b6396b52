"""Sources: file, directory, wildcard, comma list, /gcs/ paths (mounted or not), bq:// parsing."""

from __future__ import annotations

import pytest

from vertexrt import paths
from vertexrt.data import open_dataset
from vertexrt.data.sources import TableSource, expand_files, is_bigquery, parse_table

from .conftest import write_bytes


def test_directory_wildcard_and_comma_list(storage_root: str, write_jsonl) -> None:
    for name in ("a/1.jsonl", "a/2.jsonl", "a/_SUCCESS", "a/.hidden", "b/3.jsonl"):
        write_jsonl(paths.join(storage_root, name), [{"f": name}])
    names = lambda uri: [s.uri.rsplit("/", 2)[-2] + "/" + s.uri.rsplit("/", 1)[-1] for s in expand_files(uri)]  # noqa: E731
    assert names(paths.join(storage_root, "a")) == ["a/1.jsonl", "a/2.jsonl"]
    assert names(paths.join(storage_root, "a/*.jsonl")) == ["a/1.jsonl", "a/2.jsonl"]
    both = f"{paths.join(storage_root, 'a/1.jsonl')}, {paths.join(storage_root, 'b')}"
    assert names(both) == ["a/1.jsonl", "b/3.jsonl"]
    assert all(s.size > 0 for s in expand_files(both))
    ds = open_dataset(both, shuffle=False, rank=0, world_size=1)
    assert [r["f"] for r in ds] == ["a/1.jsonl", "b/3.jsonl"]


def test_gcs_fuse_path_via_the_mount_and_via_gcsfs(tmp_path, monkeypatch, gcs_server, write_jsonl) -> None:
    write_jsonl(f"gs://{gcs_server.bucket}/fuse/x.jsonl", [{"v": 1}])
    monkeypatch.setenv("VERTEXRT_FUSE_ROOT", str(tmp_path / "nomount"))
    assert list(open_dataset(f"/gcs/{gcs_server.bucket}/fuse/*.jsonl", rank=0, world_size=1)) == [{"v": 1}]
    mount = tmp_path / "mount"
    (mount / gcs_server.bucket / "fuse").mkdir(parents=True)
    (mount / gcs_server.bucket / "fuse" / "y.jsonl").write_bytes(b'{"v": 2}\n')
    monkeypatch.setenv("VERTEXRT_FUSE_ROOT", str(mount))
    ds = open_dataset(f"/gcs/{gcs_server.bucket}/fuse/*.jsonl", rank=0, world_size=1)
    assert list(ds) == [{"v": 2}] and ds.files[0].startswith(str(mount))


def test_gs_wildcard_as_vertex_writes_it(gcs_server, write_jsonl) -> None:
    base = f"gs://{gcs_server.bucket}/export-1"
    for i in range(3):
        write_jsonl(f"{base}/training-{i:05d}-of-00003.jsonl", [{"i": i}])
    write_jsonl(f"{base}/test-00000-of-00001.jsonl", [{"i": 99}])
    ds = open_dataset(f"{base}/training-*", rank=0, world_size=1, shuffle=False)
    assert [r["i"] for r in ds] == [0, 1, 2]
    assert ds.files[0].startswith("gs://")


def test_bigquery_uris() -> None:
    assert parse_table("bq://my-proj.ds_1.training") == TableSource("my-proj", "ds_1", "training")
    assert parse_table("my-proj.dataset_123_tables_2026.training").dataset == "dataset_123_tables_2026"
    assert parse_table("bq://example.com:proj.d.t").project == "example.com:proj"
    assert is_bigquery("bq://p.d.t") and is_bigquery("p.d.t")
    assert not is_bigquery("gs://b/p.d.t") and not is_bigquery("/data/train.jsonl")


def test_local_file_looking_like_a_table_is_a_file(tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    write_bytes("train.data.jsonl", b'{"a": 1}\n')
    assert not is_bigquery("train.data.jsonl")
    assert list(open_dataset("train.data.jsonl", rank=0, world_size=1)) == [{"a": 1}]


@pytest.mark.parametrize(
    "name", ["x.jsonl", "x.ndjson", "x.csv", "x.tsv", "x.tfrecord", "x.tfrecord.gz", "x.parquet"]
)
def test_format_from_extension(name: str) -> None:
    from vertexrt.data.formats.registry import format_for_uri

    fmt = format_for_uri(f"gs://b/{name}")
    assert fmt is not None and fmt.name in name.replace("ndjson", "jsonl").replace("tsv", "csv")

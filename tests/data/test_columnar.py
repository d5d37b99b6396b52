"""Columnar batches (``columnar=True``): Parquet, CSV, JSONL as ``{column: numpy array}`` of ``batch_size``
rows, with the row path's sharding, shuffle and exact cursor, handed to torch and tf as tensors."""

from __future__ import annotations

import json
from collections import Counter

import pytest

from vertexrt import paths
from vertexrt.data import open_dataset

from .conftest import SIZES_7, jsonl_bytes, write_bytes

TOTAL = sum(SIZES_7)


def write_files(root: str, kind: str) -> str:
    """``SIZES_7`` files of rows ``{"id": n, "x": n / 2}``; returns the pattern."""
    first = 0
    for index, size in enumerate(SIZES_7):
        rows = [{"id": first + i, "x": (first + i) / 2} for i in range(size)]
        uri = paths.join(root, f"part-{index:02d}.{kind}")
        if kind == "jsonl":
            write_bytes(uri, jsonl_bytes(rows))
        elif kind == "csv":
            write_bytes(uri, ("id,x\n" + "".join(f"{r['id']},{r['x']}\n" for r in rows)).encode())
        else:
            import pyarrow as pa
            import pyarrow.parquet as pq

            table = pa.table({"id": [r["id"] for r in rows], "x": [r["x"] for r in rows]})
            with paths.open(uri, "wb") as f:
                pq.write_table(table, f, row_group_size=16)
        first += size
    return paths.join(root, f"part-*.{kind}")


def ids(batches: list[dict]) -> list[int]:
    return [int(i) for b in batches for i in b["id"]]


@pytest.mark.parametrize("kind", ["parquet", "csv", "jsonl"])
def test_batches_are_columns_of_the_shard_exactly_once(storage_root: str, kind: str) -> None:
    pattern = write_files(storage_root, kind)
    seen: Counter[int] = Counter()
    for rank in range(2):
        ds = open_dataset(
            pattern, batch_size=8, columnar=True, seed=2, rank=rank, world_size=2, equalize=None
        )
        batches = list(ds)
        assert all(len(b["id"]) == 8 for b in batches[:-1]) and set(batches[0]) == {"id", "x"}
        assert all(b["x"].tolist() == [i / 2 for i in b["id"].tolist()] for b in batches)
        seen.update(ids(batches))
    assert sorted(seen) == list(range(TOTAL)) and set(seen.values()) == {1}
    equal = [
        len(list(open_dataset(pattern, batch_size=8, columnar=True, rank=r, world_size=2))) for r in range(2)
    ]
    assert equal[0] == equal[1] == TOTAL // 2 // 8


@pytest.mark.parametrize("kind", ["parquet", "csv", "jsonl"])
def test_shuffled_columns_resume_exactly(tmp_path, kind: str) -> None:
    pattern = write_files(str(tmp_path), kind)
    options = {"batch_size": 5, "columnar": True, "seed": 3, "shuffle_buffer": 20, "rank": 0, "world_size": 1}
    full = ids(list(open_dataset(pattern, **options)))
    assert sorted(full) == list(range(TOTAL)) and full != sorted(full)
    rows = [int(r["id"]) for r in open_dataset(pattern, **{**options, "columnar": False, "batch_size": 1})]
    assert sorted(rows) == sorted(full)
    for stop in (0, 1, 9, 30, len(full) // 5):
        ds = open_dataset(pattern, **options)
        it = iter(ds)
        head = ids([next(it) for _ in range(stop)])
        state = json.loads(json.dumps(ds.state_dict()))
        again = open_dataset(pattern, **options)
        again.load_state_dict(state)
        assert head + ids(list(again)) == full, stop


def test_torch_loader_hands_over_tensors(tmp_path) -> None:
    torch = pytest.importorskip("torch")
    from vertexrt.data.torch import DataLoader

    pattern = write_files(str(tmp_path), "parquet")
    loader = DataLoader(open_dataset(pattern, batch_size=16, columnar=True, rank=0, world_size=1))
    batches = list(loader)
    assert isinstance(batches[0]["id"], torch.Tensor) and batches[0]["id"].shape == (16,)
    assert sorted(int(i) for b in batches for i in b["id"]) == list(range(TOTAL))


def test_tf_dataset_of_column_batches(tmp_path) -> None:
    tf = pytest.importorskip("tensorflow")
    pattern = write_files(str(tmp_path), "csv")
    ds = open_dataset(pattern, batch_size=16, columnar=True, rank=0, world_size=2).as_tf()
    assert ds.element_spec["x"] == tf.TensorSpec((None,), tf.float64)
    assert int(ds.cardinality()) == TOTAL // 2 // 16
    assert sum(int(b["id"].shape[0]) for b in ds) == TOTAL // 2 // 16 * 16


def write_string_parquet(root: str) -> str:
    """``SIZES_7`` Parquet files of ``{"id": n, "name": "n-<n>"}``; returns the pattern."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    first = 0
    for index, size in enumerate(SIZES_7):
        n = list(range(first, first + size))
        table = pa.table({"id": n, "name": [f"n-{i}" for i in n]})
        with paths.open(paths.join(root, f"part-{index:02d}.parquet"), "wb") as f:
            pq.write_table(table, f, row_group_size=16)
        first += size
    return paths.join(root, "part-*.parquet")


@pytest.mark.parametrize("kind", ["parquet", "csv", "jsonl"])
def test_arrow_batches_are_record_batches_of_the_shard_exactly_once(storage_root: str, kind: str) -> None:
    import pyarrow as pa

    pattern = write_files(storage_root, kind)
    seen: Counter[int] = Counter()
    for rank in range(2):
        options = {"batch_size": 8, "seed": 2, "rank": rank, "world_size": 2, "equalize": None}
        batches = list(open_dataset(pattern, columnar="arrow", **options))
        assert all(isinstance(b, pa.RecordBatch) for b in batches)
        assert all(b.num_rows == 8 for b in batches[:-1]) and batches[0].schema.names == ["id", "x"]
        assert all(b["x"].to_pylist() == [i / 2 for i in b["id"].to_pylist()] for b in batches)
        # the same rows in the same order as columnar=True
        assert [i for b in batches for i in b["id"].to_pylist()] == ids(
            list(open_dataset(pattern, columnar=True, **options))
        )
        seen.update(i for b in batches for i in b["id"].to_pylist())
    assert sorted(seen) == list(range(TOTAL)) and set(seen.values()) == {1}
    equal = [
        list(open_dataset(pattern, batch_size=8, columnar="arrow", rank=r, world_size=2)) for r in range(2)
    ]
    assert len(equal[0]) == len(equal[1]) == TOTAL // 2 // 8 and {b.num_rows for b in equal[0]} == {8}


@pytest.mark.parametrize("kind", ["parquet", "csv", "jsonl"])
def test_shuffled_arrow_batches_resume_exactly(tmp_path, kind: str) -> None:
    pattern = write_files(str(tmp_path), kind)
    options = {
        "batch_size": 5,
        "columnar": "arrow",
        "seed": 3,
        "shuffle_buffer": 20,
        "rank": 0,
        "world_size": 1,
    }

    def arrow_ids(batches: list) -> list[int]:
        return [i for b in batches for i in b["id"].to_pylist()]

    full = arrow_ids(list(open_dataset(pattern, **options)))
    assert sorted(full) == list(range(TOTAL)) and full != sorted(full)
    assert full == ids(list(open_dataset(pattern, **{**options, "columnar": True})))
    for stop in (0, 1, 9, 30, len(full) // 5):
        ds = open_dataset(pattern, **options)
        it = iter(ds)
        head = arrow_ids([next(it) for _ in range(stop)])
        state = json.loads(json.dumps(ds.state_dict()))
        again = open_dataset(pattern, **options)
        again.load_state_dict(state)
        assert head + arrow_ids(list(again)) == full, stop


@pytest.mark.parametrize("columnar", [True, "arrow"])
def test_schema_drift_across_files_names_the_file_and_column(tmp_path, columnar) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    from vertexrt.errors import DataError

    pq.write_table(pa.table({"id": [1, 2], "x": [0.5, 1.0]}), tmp_path / "a.parquet")
    pq.write_table(pa.table({"id": [3, 4], "x": ["p", "q"]}), tmp_path / "b.parquet")
    pq.write_table(pa.table({"id": [5, 6]}), tmp_path / "c.parquet")
    for other, words in (("b.parquet", ["'x'", "string", "double"]), ("c.parquet", ["'x'", "lacks"])):
        files = [str(tmp_path / "a.parquet"), str(tmp_path / other)]
        for shuffle_buffer in (1, 100):  # batches across the files, and one shuffle block of both
            ds = open_dataset(
                files,
                batch_size=3,
                columnar=columnar,
                shuffle=False,
                shuffle_buffer=shuffle_buffer,
                rank=0,
                world_size=1,
            )
            with pytest.raises(DataError, match="schema drift") as err:
                list(ds)
            assert other in str(err.value) and all(w in str(err.value) for w in words), str(err.value)


@pytest.mark.parametrize("value", ["numpy", "yes", 2, None])
def test_columnar_values_are_validated(tmp_path, value) -> None:
    from vertexrt.errors import ConfigError

    pattern = write_files(str(tmp_path), "parquet")
    with pytest.raises(ConfigError, match=r"columnar=.*'arrow'"):
        open_dataset(pattern, columnar=value)


def test_torch_loader_hands_over_arrow_batches_as_tensors(tmp_path) -> None:
    torch = pytest.importorskip("torch")
    from vertexrt.data.torch import DataLoader

    pattern = write_string_parquet(str(tmp_path))
    loader = DataLoader(open_dataset(pattern, batch_size=16, columnar="arrow", rank=0, world_size=1))
    batches = list(loader)
    assert isinstance(batches[0]["id"], torch.Tensor) and batches[0]["id"].dtype == torch.int64
    assert list(batches[0]["name"]) == [f"n-{int(i)}" for i in batches[0]["id"]]  # strings as numpy gives
    assert sorted(int(i) for b in batches for i in b["id"]) == list(range(TOTAL))
    assert loader.state_dict()["epoch"] == 1


def test_tf_dataset_of_arrow_batches(tmp_path) -> None:
    tf = pytest.importorskip("tensorflow")
    pattern = write_string_parquet(str(tmp_path))
    ds = open_dataset(pattern, batch_size=16, columnar="arrow", rank=0, world_size=2).as_tf()
    assert ds.element_spec["name"] == tf.TensorSpec((None,), tf.string)
    assert ds.element_spec["id"] == tf.TensorSpec((None,), tf.int64)
    batch = next(iter(ds))
    assert [s.decode() for s in batch["name"].numpy()] == [f"n-{i}" for i in batch["id"].numpy()]
    assert int(ds.cardinality()) == TOTAL // 2 // 16


def test_bigquery_storage_read_hands_out_arrow_batches(bq_emulator, monkeypatch) -> None:
    import pyarrow as pa

    from .test_bigquery_storage import ROWS, use

    use(bq_emulator(True), monkeypatch)
    ds = open_dataset("bq://proj-1.ds.big", batch_size=30_000, columnar="arrow", rank=0, world_size=1)
    batches = list(ds)
    assert all(isinstance(b, pa.RecordBatch) for b in batches) and batches[0].num_rows == 30_000
    assert {"id", "name", "score"} <= set(batches[0].schema.names)
    assert sorted(i for b in batches for i in b["id"].to_pylist()) == list(range(ROWS))


def test_csv_type_drift_across_files_names_the_file_and_column(tmp_path) -> None:
    from vertexrt.errors import DataError

    (tmp_path / "a.csv").write_text("id,x\n1,0.5\n2,1.5\n")
    (tmp_path / "b.csv").write_text("id,x\n3,p\n4,q\n")
    files = [str(tmp_path / "a.csv"), str(tmp_path / "b.csv")]
    ds = open_dataset(files, batch_size=3, columnar="arrow", shuffle=False, rank=0, world_size=1)
    with pytest.raises(DataError, match=r"column 'x' is string in .*b\.csv and double in .*a\.csv"):
        list(ds)


TYPED_ROWS = 100
BIG_ID = 2**53  # + n: float64 cannot hold 2**53 + 1


def typed_table(emu, monkeypatch) -> str:
    """``ds.typed``: ``n`` 0..99, a nullable INT64 ``id`` past 2**53, a nullable TIMESTAMP ``ts`` and DATE
    ``d``."""
    from vertexrt.clients import bigquery_client

    from .test_bigquery_storage import use

    use(emu, monkeypatch)
    bigquery_client("proj-1").query(
        "CREATE TABLE IF NOT EXISTS ds.typed AS SELECT x AS n, "
        f"IF(MOD(x, 3) = 0, NULL, x + {BIG_ID}) AS id, "
        "IF(MOD(x, 5) = 4, NULL, "
        "TIMESTAMP_ADD(TIMESTAMP '2020-01-01 00:00:00 UTC', INTERVAL x SECOND)) AS ts, "
        "IF(MOD(x, 7) = 6, NULL, DATE_ADD(DATE '2020-01-01', INTERVAL x DAY)) AS d "
        f"FROM UNNEST(GENERATE_ARRAY(0, {TYPED_ROWS - 1})) AS x"
    ).result()
    return "bq://proj-1.ds.typed"


def expected(n: int, nat: int) -> tuple[int, int, int]:
    """``(id, ts, d)`` of row ``n`` as tensors carry them: NULL id 0, NULL timestamp / date ``nat``."""
    epoch_2020 = 1_577_836_800  # 2020-01-01 in seconds since 1970-01-01 UTC; 18,262 days
    return (
        0 if n % 3 == 0 else BIG_ID + n,
        nat if n % 5 == 4 else (epoch_2020 + n) * 1_000_000,
        nat if n % 7 == 6 else 18_262 + n,
    )


@pytest.mark.parametrize("columnar", [True, "arrow"])
def test_bigquery_int64_with_nulls_stays_exact_and_timestamps_reach_torch_and_tf(
    bq_emulator, monkeypatch, columnar
) -> None:
    import numpy as np
    import tensorflow as tf

    from vertexrt.data.torch import DataLoader

    uri = typed_table(bq_emulator(True), monkeypatch)

    def opened() -> object:
        return open_dataset(uri, batch_size=16, columnar=columnar, shuffle=False, rank=0, world_size=1)

    if columnar is True:  # numpy: a masked int64 column, exact; datetime64 with NaT for NULL
        batch = next(iter(opened()))
        assert isinstance(batch["id"], np.ma.MaskedArray) and batch["id"].dtype == np.int64
        assert batch["id"][1] == BIG_ID + 1 and batch["id"].mask.tolist()[:4] == [True, False, False, True]
        assert batch["ts"].dtype == np.dtype("datetime64[us]") and batch["d"].dtype == np.dtype(
            "datetime64[D]"
        )
        assert np.isnat(batch["ts"][4]) and str(batch["d"][1]) == "2020-01-02"
    nat = -(2**63)
    rows = [expected(n, nat) for n in range(TYPED_ROWS)]
    names = ("n", "id", "ts", "d")
    torch_rows = []
    for batch in DataLoader(opened()):
        assert all(str(batch[k].dtype) == "torch.int64" for k in names)
        torch_rows += zip(*(batch[k].tolist() for k in names), strict=True)
    assert [row[1:] for row in sorted(torch_rows)] == rows
    tf_rows = []
    for batch in opened().as_tf():
        assert all(batch[k].dtype == tf.int64 for k in names)
        tf_rows += zip(*(batch[k].numpy().tolist() for k in names), strict=True)
    assert [row[1:] for row in sorted(tf_rows)] == rows

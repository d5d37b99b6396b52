"""Records with timestamps, dates and missing values through real DataLoaders and tf.data: timestamps and
dates batch as the int64 numbers the columnar path gives, text stays a list, and a missing number is a
DataError naming its column instead of a TypeError from deep inside the loader."""

from __future__ import annotations

import datetime
import json
from pathlib import Path
from typing import Any

import pytest

from vertexrt.data import Parquet, open_dataset
from vertexrt.errors import DataError

torch = pytest.importorskip("torch")
from vertexrt.data.torch import DataLoader  # noqa: E402

UTC = datetime.timezone.utc
ROWS = 12
START = datetime.datetime(2024, 2, 29, 23, 59, 58, 123456, tzinfo=UTC)


def timestamp(i: int) -> datetime.datetime:
    return START + datetime.timedelta(seconds=i, microseconds=7 * i)


def write_parquet(root: Path) -> str:
    """Two files of ``ROWS`` rows: id, x, a UTC timestamp, a zone-less DATETIME, a date, text with NULLs."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    for part in range(2):
        ids = range(part * ROWS, (part + 1) * ROWS)
        table = pa.table(
            {
                "id": pa.array(ids, pa.int64()),
                "x": pa.array([i / 4 for i in ids], pa.float64()),
                "ts": pa.array([timestamp(i) for i in ids], pa.timestamp("us", tz="UTC")),
                "local": pa.array([timestamp(i).replace(tzinfo=None) for i in ids], pa.timestamp("us")),
                "day": pa.array([timestamp(i).date() + datetime.timedelta(days=i) for i in ids], pa.date32()),
                "name": pa.array([None if i % 5 == 0 else f"n{i}" for i in ids], pa.string()),
            }
        )
        pq.write_table(table, root / f"part-{part}.parquet")
    return str(root / "part-*.parquet")


def expected(i: int) -> dict[str, Any]:
    micros = (timestamp(i) - datetime.datetime(1970, 1, 1, tzinfo=UTC)) // datetime.timedelta(microseconds=1)
    day = (timestamp(i).date() + datetime.timedelta(days=i) - datetime.date(1970, 1, 1)).days
    return {"x": i / 4, "ts": micros, "local": micros, "day": day}


def by_id(batches: list[dict[str, Any]], columns: tuple[str, ...]) -> dict[int, dict[str, Any]]:
    rows = {}
    for batch in batches:
        for at, i in enumerate(batch["id"].tolist()):
            rows[i] = {c: batch[c][at].item() for c in columns}
    return rows


@pytest.mark.parametrize("workers", [0, 2])
def test_timestamps_and_dates_batch_as_the_columnar_path_gives_them(tmp_path: Path, workers: int) -> None:
    pattern = write_parquet(tmp_path)
    options: dict[str, Any] = {"shuffle": False, "rank": 0, "world_size": 1, "equalize": None}
    extra = {"multiprocessing_context": "fork", "timeout": 120} if workers else {}
    rows = list(DataLoader(open_dataset(pattern, **options), batch_size=4, num_workers=workers, **extra))
    for batch in rows:
        assert batch["ts"].dtype == batch["local"].dtype == batch["day"].dtype == torch.int64
        assert isinstance(batch["name"], list)  # text stays a list, a NULL in it kept as None
    columns = ("x", "ts", "local", "day")
    got = by_id(rows, columns)
    assert got == {i: expected(i) for i in range(2 * ROWS)}
    names = {i: n for batch in rows for i, n in zip(batch["id"].tolist(), batch["name"], strict=True)}
    assert names == {i: None if i % 5 == 0 else f"n{i}" for i in range(2 * ROWS)}
    columnar = open_dataset(pattern, columnar=True, batch_size=4, **options)
    assert by_id(list(DataLoader(columnar)), columns) == got


def write_jsonl_with_a_gap(root: Path, gap: str) -> str:
    """``ROWS`` records ``{"id", "label"}``; record 6's label is null (``gap="null"``) or absent."""
    path = root / "a.jsonl"
    with path.open("w") as f:
        for i in range(ROWS):
            record: dict[str, Any] = {"id": i, "label": i % 3}
            if i == 6:
                if gap == "null":
                    record["label"] = None
                else:
                    del record["label"]
            f.write(json.dumps(record) + "\n")
    return str(path)


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("gap", ["null", "absent"])
def test_a_missing_number_is_a_data_error_naming_the_column(tmp_path: Path, workers: int, gap: str) -> None:
    uri = write_jsonl_with_a_gap(tmp_path, gap)
    ds = open_dataset(uri, shuffle=False, rank=0, world_size=1)
    extra = {"multiprocessing_context": "fork", "timeout": 120} if workers else {}
    loader = DataLoader(ds, batch_size=4, num_workers=workers, **extra)
    got = []
    with pytest.raises(DataError, match=r"column 'label' has a missing value .* row \d of the batch.*fill"):
        for batch in loader:
            got.append(batch)
    assert all(6 not in batch["id"].tolist() for batch in got)  # batches before it, as tensors


def test_a_plain_torch_dataloader_takes_collate_rows(tmp_path: Path) -> None:
    from vertexrt.data.torch import collate_rows

    pattern = write_parquet(tmp_path)
    ds = open_dataset(pattern, shuffle=False, rank=0, world_size=1, equalize=None)
    loader = torch.utils.data.DataLoader(ds.as_torch(), batch_size=5, collate_fn=collate_rows)
    assert by_id(list(loader), ("ts", "day")) == {
        i: {k: v for k, v in expected(i).items() if k in ("ts", "day")} for i in range(2 * ROWS)
    }


def test_tf_gives_the_same_numbers_and_names_the_column_of_a_missing_value(tmp_path: Path) -> None:
    tf = pytest.importorskip("tensorflow")
    pattern = write_parquet(tmp_path)
    numbers = Parquet(columns=["id", "x", "ts", "local", "day"])  # a text NULL is refused by tf.data too
    ds = open_dataset(pattern, format=numbers, shuffle=False, rank=0, world_size=1, equalize=None)
    records = list(ds.as_tf())
    assert records[0]["ts"].dtype == tf.int64
    got = {int(r["id"]): {c: r[c].numpy().item() for c in ("x", "ts", "local", "day")} for r in records}
    assert got == {i: expected(i) for i in range(2 * ROWS)}
    gap = open_dataset(write_jsonl_with_a_gap(tmp_path, "null"), shuffle=False, rank=0, world_size=1)
    with pytest.raises(tf.errors.OpError, match=r"DataError: column 'label' has a missing value"):
        list(gap.as_tf())


def test_a_batch_whose_column_is_all_missing_is_refused_not_kept_as_a_list() -> None:
    from vertexrt.data.torch import collate_rows

    batch = collate_rows([{"label": 1, "name": "a"}, {"label": 2, "name": None}])
    assert batch["label"].tolist() == [1, 2] and batch["name"] == ["a", None]
    with pytest.raises(DataError, match=r"column 'label' has a missing value .* row 0 of the batch"):
        collate_rows([{"label": None, "name": "a"}, {"label": None, "name": "b"}])

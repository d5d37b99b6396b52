"""Row values as the torch and tf.data adapters hand them to a tensor, the row path's counterpart of
:func:`vertexrt.data.columns.tensor_ready`: a timestamp as int64 microseconds since 1970-01-01 UTC (one with
no time zone, a BigQuery DATETIME, read as UTC), a date as days since then, a time of day as microseconds
since midnight, a NUMERIC as a float; a missing value (``None``, a NULL, an absent key) is refused with a
:class:`~vertexrt.errors.DataError` naming the column and the fix, since a tensor has no place for it.

Example:
    >>> tensor_value(datetime.datetime(1970, 1, 2, tzinfo=datetime.timezone.utc), "ts")
    86400000000
"""

from __future__ import annotations

import datetime
import decimal
from collections.abc import Mapping
from typing import Any

from vertexrt.errors import DataError

_EPOCH = datetime.datetime(1970, 1, 1, tzinfo=datetime.timezone.utc)
_EPOCH_DAY = datetime.date(1970, 1, 1)
_MICROSECOND = datetime.timedelta(microseconds=1)
CONVERTED = (datetime.date, datetime.time, decimal.Decimal)
"""The value types :func:`tensor_value` turns into numbers (``datetime.datetime`` is a ``date``)."""


def missing(column: str, row: int | None = None) -> DataError:
    """The typed error for a missing value in ``column`` (at ``row`` of its batch when known)."""
    where = f"row {row} of the batch" if row is not None else "a record"
    return DataError(
        f"column {column!r} has a missing value (None / NULL) in {where}, which a tensor cannot hold: fill "
        "it in the data (in BigQuery, IFNULL / COALESCE in a query), or fill it yourself before batching "
        "(torch: DataLoader(..., collate_fn=...); tf.data: from_generator over the dataset's records)"
    )


def tensor_value(value: Any, column: str, row: int | None = None) -> Any:
    """``value`` with its dates, times and decimals as numbers (in lists and dicts too).

    Raises:
        DataError: a missing value, naming ``column`` (``column.key`` / ``column[i]`` inside).
    """
    if value is None:
        raise missing(column, row)
    if isinstance(value, CONVERTED):
        return _number(value)
    if isinstance(value, Mapping):
        return {k: tensor_value(v, f"{column}.{k}", row) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [tensor_value(v, f"{column}[{i}]", row) for i, v in enumerate(value)]
    return value


def _number(value: Any) -> int | float:
    if isinstance(value, datetime.datetime):
        aware = value if value.tzinfo is not None else value.replace(tzinfo=datetime.timezone.utc)
        return (aware - _EPOCH) // _MICROSECOND
    if isinstance(value, datetime.date):
        return (value - _EPOCH_DAY).days
    if isinstance(value, datetime.time):
        return ((value.hour * 60 + value.minute) * 60 + value.second) * 1_000_000 + value.microsecond
    return float(value)

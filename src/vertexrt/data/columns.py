"""Column blocks: what a columnar reader hands to the cursor machinery in place of a list of raw records.

A reader yields :class:`Columns` (one ``pyarrow.RecordBatch`` and the file it came from); the cursor slices
(with a step, for record striding), joins (:func:`concat`) and permutes (:func:`take`) them in Arrow, with
no per-row step and no numpy conversion. ``columnar=True`` turns each handed-out block into
:class:`NumpyColumns` (``{name: numpy array}``) once; ``columnar="arrow"`` hands out the Arrow batches.

Example:
    >>> cols = Columns(pa.record_batch({"x": [0, 1, 2, 3]}), "a.parquet")
    >>> len(cols[1::2]), concat([cols, cols]).batch.column("x").to_pylist()
    (2, [0, 1, 2, 3, 0, 1, 2, 3])
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import chain
from typing import Any

from vertexrt.errors import DataError


class Columns:
    """One ``pyarrow.RecordBatch`` of a file (``uri``, named in schema drift errors)."""

    __slots__ = ("batch", "uri")

    def __init__(self, batch: Any, uri: str = ""):
        self.batch = batch
        self.uri = uri

    @classmethod
    def from_arrow(cls, batch: Any, uri: str = "") -> Columns:
        """The block of a ``pyarrow.RecordBatch`` read from ``uri``."""
        return cls(batch, uri)

    @property
    def data(self) -> dict[str, Any]:
        """The columns as numpy arrays (numeric ones zero-copy where Arrow allows it)."""
        return self.numpy().data

    def numpy(self) -> NumpyColumns:
        """These columns as :class:`NumpyColumns` (see :func:`numpy_column`)."""
        batch = self.batch
        data = {
            name: numpy_column(column) for name, column in zip(batch.schema.names, batch.columns, strict=True)
        }
        return NumpyColumns(data, batch.num_rows)

    def __len__(self) -> int:
        return int(self.batch.num_rows)

    def __getitem__(self, index: slice) -> Columns:
        start, stop, step = index.indices(self.batch.num_rows)
        if step == 1:
            return Columns(self.batch.slice(start, max(0, stop - start)), self.uri)
        import numpy as np

        return Columns(self.batch.take(np.arange(start, stop, step)), self.uri)


def numpy_column(column: Any) -> Any:
    """A ``pyarrow.Array`` as numpy, exact: numeric columns zero-copy where Arrow allows it; an integer or
    boolean column with NULLs a ``numpy.ma.MaskedArray`` of its own dtype (NULL masked, 0 beneath: never
    float64, which rounds integers past 2**53); TIMESTAMP / DATETIME ``datetime64[us]`` (UTC), DATE
    ``datetime64[D]``, NULL as ``NaT``; strings, bytes, lists and structs object arrays.

    Example:
        >>> ids = numpy_column(pa.array([2**53 + 1, None]))
        >>> ids.dtype, ids[0] == 2**53 + 1, ids.mask.tolist()
        (dtype('int64'), True, [False, True])
    """
    import pyarrow as pa

    kind = column.type
    if column.null_count and (pa.types.is_integer(kind) or pa.types.is_boolean(kind)):
        import numpy as np

        values = column.fill_null(False if pa.types.is_boolean(kind) else 0).to_numpy(zero_copy_only=False)
        return np.ma.MaskedArray(values, mask=column.is_null().to_numpy(zero_copy_only=False))
    return column.to_numpy(zero_copy_only=False)


def tensor_ready(array: Any) -> Any:
    """A numpy column as the torch and tf adapters hand it over: ``datetime64`` as int64 in its unit
    (TIMESTAMP: microseconds since 1970-01-01 UTC, DATE: days since then; ``NaT``, a NULL, as -2**63), a
    masked integer or boolean column as its values with NULL as 0 / False (the mask is in the numpy
    batch); anything else as it is.

    Example:
        >>> tensor_ready(np.array(["1970-01-02"], "datetime64[D]"))
        array([1])
    """
    import numpy as np

    if isinstance(array, np.ma.MaskedArray):
        return array.filled(0)
    if isinstance(array, np.ndarray) and array.dtype.kind in "mM":
        return array.view(np.int64)
    return array


def numpy_batch(batch: Any) -> dict[str, Any]:
    """A ``pyarrow.RecordBatch`` as ``{name: numpy array}``, as ``columnar=True`` gives it
    (:func:`numpy_column`).

    Example:
        >>> numpy_batch(pa.record_batch({"x": [1, 2]}))["x"].dtype
        dtype('int64')
    """
    return Columns(batch).data


class NumpyColumns:
    """Equal-length numpy arrays by column name (``columnar=True`` batches)."""

    __slots__ = ("data", "rows")

    def __init__(self, data: dict[str, Any], rows: int):
        self.data = data
        self.rows = rows

    def __len__(self) -> int:
        return self.rows

    def __getitem__(self, index: slice) -> NumpyColumns:
        start, stop, step = index.indices(self.rows)
        return NumpyColumns({k: v[index] for k, v in self.data.items()}, len(range(start, stop, step)))


def same_schema(first: Columns, other: Columns) -> None:
    """Raise a DataError naming both files and the first column that differs, unless the schemas agree
    (metadata aside)."""
    a, b = first.batch.schema, other.batch.schema
    if a.equals(b, check_metadata=False):
        return
    here, there = other.uri or "a later batch", first.uri or "the first batch"
    for name in dict.fromkeys(a.names + b.names):
        if name not in a.names or name not in b.names:
            have = "lacks" if name not in b.names else "has an extra"
            detail = f"{here} {have} column {name!r} (compared with {there})"
            break
        fa, fb = a.field(name), b.field(name)
        if not fa.equals(fb):
            detail = f"column {name!r} is {_kind(fb)} in {here} and {_kind(fa)} in {there}"
            break
    else:
        detail = f"{here} orders its columns {b.names}, {there} {a.names}"
    raise DataError(
        f"schema drift in the columnar reader: {detail}. Every file must have the same columns and types: "
        "rewrite the odd file, select columns (Parquet(columns=[...])), fix types (CSV(types={...})), or "
        "read with columnar=False"
    )


def _kind(field: Any) -> str:
    return f"{field.type}" if field.nullable else f"{field.type} not null"


def concat(pieces: Sequence[Any]) -> Any:
    """``pieces`` (lists of raw records, :class:`Columns` or :class:`NumpyColumns`) joined into one;
    Arrow blocks of different schemas raise a DataError naming the files and the column."""
    if not pieces:
        return []
    first = pieces[0]
    if isinstance(first, Columns):
        if len(pieces) == 1:
            return first
        import pyarrow as pa

        for piece in pieces[1:]:
            same_schema(first, piece)
        batches = [p.batch for p in pieces]
        if any(b.schema.metadata != batches[0].schema.metadata for b in batches):
            batches = [b.replace_schema_metadata(batches[0].schema.metadata) for b in batches]
        if hasattr(pa, "concat_batches"):  # pyarrow >= 19
            return Columns(pa.concat_batches(batches), first.uri)
        return Columns(pa.Table.from_batches(batches).combine_chunks().to_batches()[0], first.uri)
    if isinstance(first, NumpyColumns):
        if len(pieces) == 1:
            return first
        import numpy as np

        def joined(arrays: list[Any]) -> Any:  # a column with NULLs in any piece stays masked
            masked = any(isinstance(a, np.ma.MaskedArray) for a in arrays)
            return np.ma.concatenate(arrays) if masked else np.concatenate(arrays)

        return NumpyColumns(
            {k: joined([p.data[k] for p in pieces]) for k in first.data}, sum(p.rows for p in pieces)
        )
    return list(chain.from_iterable(pieces))


def take(raws: Any, order: Any) -> Any:
    """``raws`` permuted by ``order`` (a numpy index array)."""
    if isinstance(raws, Columns):
        return Columns(raws.batch.take(order), raws.uri)
    return list(map(raws.__getitem__, order.tolist()))


ARROW_BLOCK = 4 << 20
"""Bytes per block that Arrow's CSV / JSON readers parse at a time."""


def arrow_text_batches(uri: str, compression: str, open_reader: Any, errors: Any) -> Any:
    """``(0, Columns)`` for each batch an Arrow streaming reader (``open_reader(file)``) parses from
    ``uri``. Every chunk is at position 0: a cursor counts rows from the file's start (exact; resuming
    mid-file re-reads the file up to it). Unparseable data is a bad record that ends the file."""
    import pyarrow as pa

    from vertexrt.data._io import open_at

    f = open_at(uri, compression, 0)
    try:
        reader = open_reader(f)
        while True:
            try:
                batch = reader.read_next_batch()
            except StopIteration:
                return
            if batch.num_rows:
                yield 0, Columns(batch, uri)
    except (pa.ArrowException, ValueError) as err:
        if "Empty CSV file" in str(err):
            return
        errors.bad(f"{uri}: unreadable for the columnar reader ({err}); the rest of the file is not read")
    finally:
        f.close()

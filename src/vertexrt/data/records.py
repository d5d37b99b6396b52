"""One pass over a dataset's records, handed out by C iterators (no Python frame per record), and the
count of a chunk's records a pass has handed out (what a live cursor is made from)."""

from __future__ import annotations

from collections import deque
from collections.abc import Generator, Iterator
from itertools import chain
from typing import Any


class Records(chain):  # type: ignore[type-arg]
    """One pass over a dataset's records: a C iterator (no Python frame per record) that, like a generator,
    can be closed early — the reader's place is kept for ``state_dict()`` and its read-ahead stops.

    Example:
        >>> it = iter(ds); first = next(it); it.close()  # doctest: +SKIP
    """

    _runs: Generator[Any, None, None]

    @classmethod
    def of(cls, runs: Generator[Any, None, None]) -> Records:
        records: Records = cls.from_iterable(runs)  # type: ignore[assignment]  # cls's own instance
        records._runs = runs
        return records

    def close(self) -> None:
        """End the pass here: the place is recorded, and what is left of the current run is dropped."""
        self._runs.close()
        deque(self, maxlen=0)  # the run already handed to the chain; the closed generator gives no more


def consumed(end: int, records: Iterator[Any]) -> int:
    """Records of a chunk handed out: ``records`` iterates over the chunk's records up to index ``end``."""
    return end - records.__length_hint__()  # type: ignore[attr-defined,no-any-return]

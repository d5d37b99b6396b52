"""The data audit of ``local-run --chaos``: what one reader delivered in an epoch, as a count and an
order-independent digest (on only with :mod:`vertexrt.audit`).

A record's identity is a hash of its raw bytes (the line, the TFRecord payload, the row's values), so the
same record has the same identity however the reader's chunks were cut, whichever reader read it, and
before or after a resume. The digest is the sum of the identities modulo 2**64 (a multiset hash: a
record delivered twice adds twice, a skipped one is missing), so a run whose every epoch delivered the
reference's records exactly once has the reference's digests and counts.

The tally so far travels in the reader's saved state (beside its cursor, only when auditing), so the
digest of an epoch continues across a preemption and resume.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from typing import Any

from vertexrt.errors import DataError

MASK = (1 << 64) - 1


def identity(raw: Any) -> int:
    """A raw record's identity: 64 bits of BLAKE2b of its bytes (``repr`` for a row of values)."""
    data = raw if isinstance(raw, bytes) else repr(raw).encode()
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")


class Tally:
    """Records one reader delivered in ``epoch``: ``count`` and ``digest``; ``read`` is True once this
    process delivered some itself (a tally only loaded from a state is False)."""

    __slots__ = ("chunk", "count", "digest", "epoch", "read", "upto")

    def __init__(self, epoch: int, count: int = 0, digest: int = 0) -> None:
        self.epoch = epoch
        self.count = count
        self.digest = digest
        self.read = False
        self.chunk: Any = None  # the raw records being handed out (a list), and how many are folded
        self.upto = 0

    def fold(self, raws: Iterable[Any]) -> None:
        """Add ``raws`` (delivered) to the tally."""
        total = self.digest
        n = 0
        for raw in raws:
            total += identity(raw)
            n += 1
        self.digest = total & MASK
        self.count += n
        self.read = self.read or n > 0

    def fold_rows(self, columns: Any) -> None:
        """Add the rows of a ``pyarrow.RecordBatch`` (delivered as a column batch) to the tally."""
        self.fold(columns.to_pylist())  # rows as dicts: the identities the row reader gives them

    def enter(self, records: list[Any] | None) -> None:
        """The reader moves on to ``records`` (None: the epoch's end): the rest of the chunk before was
        delivered."""
        if self.chunk is not None:
            self.fold(self.chunk[self.upto :])
        self.chunk, self.upto = records, 0

    def catch_up(self, consumed: int) -> None:
        """The current chunk's first ``consumed`` records are delivered."""
        if self.chunk is not None and consumed > self.upto:
            self.fold(self.chunk[self.upto : consumed])
            self.upto = consumed

    def detached(self) -> Tally:
        """This tally without its chunk (to pickle into a DataLoader worker)."""
        copy = Tally(self.epoch, self.count, self.digest)
        copy.read = self.read
        return copy

    def to_dict(self) -> dict[str, Any]:
        return {"count": self.count, "digest": f"{self.digest:016x}"}

    @classmethod
    def from_dict(cls, epoch: int, data: Any, where: str) -> Tally:
        """The tally saved as ``data`` (a cursor's ``audit`` field), checked.

        Raises:
            DataError: naming ``where``, when the field was damaged or edited.
        """
        count = data.get("count") if isinstance(data, dict) else None
        digest = data.get("digest") if isinstance(data, dict) else None
        if type(count) is not int or count < 0 or not isinstance(digest, str) or len(digest) != 16:
            raise DataError(
                f"data state field {where}={str(data)[:80]!r} is not a data audit tally "
                "({'count': N, 'digest': 16 hex digits}): restore the state exactly as state_dict() "
                "returned it"
            )
        try:
            value = int(digest, 16)
        except ValueError:
            raise DataError(f"data state field {where}.digest={digest!r} is not 16 hex digits") from None
        return cls(epoch, count, value)

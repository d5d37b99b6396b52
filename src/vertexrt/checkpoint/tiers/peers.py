"""Who keeps a copy of whose fast steps, and a step's files sent from one rank to another (gloo).

Ranks are grouped by VM (replica): rank ``r`` is local rank ``r % L`` of replica ``r // L`` (``L`` ranks per
VM, contiguous as torchrun and ``vertexrt.distributed.spawn`` number them). Copies of rank ``r``'s steps go
to the same local rank on replicas ``v + 1, ..., v + peers`` (mod the number of replicas): always another VM,
so losing one VM loses no state, and losing two neighbouring VMs loses the first one's.

A step travels as three kinds of message on a dedicated gloo group: a JSON header (step, file names and
sizes), the manifest, then each data file; the receiver commits it like a local write.

Example:
    >>> ring = PeerRing(rank=1, world_size=6, local_world_size=2, peers=1)
    >>> ring.targets(), ring.sources()
    ([3], [5])
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from vertexrt.checkpoint import manifest as manifest_format
from vertexrt.checkpoint.tiers.local import LocalSteps, check_name
from vertexrt.distributed import collectives
from vertexrt.errors import CheckpointError

#: The largest header a peer may announce (step, file names and sizes).
MAX_HEADER_BYTES = 1 << 20


@dataclass(frozen=True)
class PeerRing:
    """This rank's place among the VMs, and the ranks that copy its steps (and whose steps it copies)."""

    rank: int
    world_size: int
    local_world_size: int
    peers: int

    @property
    def replicas(self) -> int:
        return max(1, self.world_size // self.local_world_size)

    @property
    def copies(self) -> int:
        """Peer copies actually made: at most one per other VM."""
        return min(self.peers, self.replicas - 1)

    def replica_of(self, rank: int) -> int:
        return rank // self.local_world_size

    def targets(self, rank: int | None = None) -> list[int]:
        """The ranks that keep copies of ``rank``'s (default: this rank's) steps, nearest VM first."""
        rank = self.rank if rank is None else rank
        replica, local = divmod(rank, self.local_world_size)
        return [
            ((replica + k) % self.replicas) * self.local_world_size + local for k in range(1, self.copies + 1)
        ]

    def sources(self) -> list[int]:
        """The ranks whose steps this rank keeps copies of."""
        replica, local = divmod(self.rank, self.local_world_size)
        return [
            ((replica - k) % self.replicas) * self.local_world_size + local for k in range(1, self.copies + 1)
        ]


def send_step(steps: LocalSteps, step: int, dst: int, group: Any, dist: Any) -> list[Any]:
    """Start sending committed ``step`` of ``steps`` to rank ``dst``; wait with ``collectives.wait_sent``."""
    manifest, files = steps.export(step)
    header = json.dumps({"step": step, "files": files}).encode()
    sent = collectives.send_bytes(header, dst, group, dist)
    sent += collectives.send_bytes(manifest, dst, group, dist)
    for name, size in files:
        sent += collectives.send_bytes(steps.file(step, name, size), dst, group, dist)
    return sent


def recv_step(steps: LocalSteps, src: int, group: Any, dist: Any) -> int:
    """Receive the step rank ``src`` sends (:func:`send_step`), commit it into ``steps``; return its number.

    Raises:
        CheckpointError: the peer announced something out of bounds (the copy is not committed).
    """
    where = f"the fast checkpoint copy from rank {src}"
    try:
        header = json.loads(bytes(collectives.recv_bytes(src, group, dist, MAX_HEADER_BYTES)))
        step, files = int(header["step"]), [(str(n), int(s)) for n, s in header["files"]]
        if step < 0 or len(files) > manifest_format.MAX_FILES:
            raise ValueError(f"step {step} with {len(files)} files")
    except (ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(f"{where}: unreadable header ({exc}); the copy is skipped") from None
    try:
        manifest = bytes(collectives.recv_bytes(src, group, dist, manifest_format.MAX_MANIFEST_BYTES))
        received = [
            (check_name(name, where), collectives.recv_bytes(src, group, dist, size)) for name, size in files
        ]
    except ValueError as exc:
        raise CheckpointError(f"{where}: {exc}; the copy is skipped") from None
    for (name, size), (_, data) in zip(files, received, strict=True):
        if len(data) != size:
            raise CheckpointError(f"{where}: {name} arrived with {len(data)} bytes, announced {size}")
    steps.receive(step, manifest, received)
    return step

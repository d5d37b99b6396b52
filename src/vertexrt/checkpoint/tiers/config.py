"""What a user asks of the fast tier (:class:`FastTier`) and where on this VM it writes.

The local directory is ``VERTEXRT_LOCAL_CHECKPOINT_DIR`` when set, else the RAM disk ``/dev/shm`` when it is
writable and has :data:`MIN_RAM_DISK_FREE` bytes free, else the VM's local disk (the temp directory). The
tier can also be switched on without code: ``VERTEXRT_FAST_CHECKPOINT_EVERY=<steps>`` (and optionally
``VERTEXRT_FAST_CHECKPOINT_PEERS=<n>``, default 1) gives every manager made without ``fast=`` a fast tier.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from dataclasses import dataclass, field

from vertexrt.checkpoint.policies import EveryNSteps, SavePolicy
from vertexrt.errors import ConfigError

LOCAL_DIR_VARIABLE = "VERTEXRT_LOCAL_CHECKPOINT_DIR"
EVERY_VARIABLE = "VERTEXRT_FAST_CHECKPOINT_EVERY"
PEERS_VARIABLE = "VERTEXRT_FAST_CHECKPOINT_PEERS"
RAM_DISK = "/dev/shm"
#: The RAM disk is used by default only with at least this much free space.
MIN_RAM_DISK_FREE = 2 << 30
#: Fast steps kept per tier (own copies, and each peer's copies).
KEEP = 2


@dataclass(frozen=True)
class FastTier:
    """A fast tier under the durable one: every rank's state on local disk and on ``peers`` other VMs.

    Args:
        every: when a fast step is written (e.g. ``EveryNSteps(10)``); checked at each ``save()`` call.
        peers: how many other VMs (replica index + 1, + 2, ... mod the number of VMs) keep a copy of each
            rank's fast steps; 0 keeps local copies only.
        directory: the local directory; default ``VERTEXRT_LOCAL_CHECKPOINT_DIR``, else ``/dev/shm`` or
            the VM's local disk (see :func:`local_root`).
    """

    every: SavePolicy = field(default_factory=lambda: EveryNSteps(10))
    peers: int = 1
    directory: str | None = None

    def __post_init__(self) -> None:
        if not callable(getattr(self.every, "should_save", None)):
            raise ConfigError(f"FastTier(every={self.every!r}): it needs a should_save() method")
        if isinstance(self.peers, bool) or not isinstance(self.peers, int) or self.peers < 0:
            raise ConfigError(f"FastTier(peers={self.peers!r}): give a number of peer VMs >= 0")

    @classmethod
    def from_environment(cls) -> FastTier | None:
        """The tier ``VERTEXRT_FAST_CHECKPOINT_EVERY`` / ``_PEERS`` ask for, or None when unset.

        Raises:
            ConfigError: a variable is not a whole number in range.
        """
        every = os.environ.get(EVERY_VARIABLE, "").strip()
        if not every:
            return None
        peers = os.environ.get(PEERS_VARIABLE, "").strip() or "1"
        return cls(
            every=EveryNSteps(_whole(EVERY_VARIABLE, every, 1)), peers=_whole(PEERS_VARIABLE, peers, 0)
        )


def _whole(name: str, raw: str, low: int) -> int:
    if not raw.isdigit() or int(raw) < low:
        raise ConfigError(f"{name}={raw!r}: give a whole number >= {low}, or unset it")
    return int(raw)


def local_root(tier: FastTier) -> tuple[str, str]:
    """``(directory, why)``: where this VM's fast steps live, and why that one (for the log line)."""
    if tier.directory:
        return tier.directory, "FastTier(directory=...)"
    explicit = os.environ.get(LOCAL_DIR_VARIABLE, "").strip()
    if explicit:
        return explicit, LOCAL_DIR_VARIABLE
    try:
        free = shutil.disk_usage(RAM_DISK).free
    except OSError:
        free = 0
    if free >= MIN_RAM_DISK_FREE and os.access(RAM_DISK, os.W_OK):
        return RAM_DISK, f"RAM disk, {free / 2**30:.1f} GiB free"
    return tempfile.gettempdir(), f"local disk ({RAM_DISK} has {free / 2**30:.1f} GiB free)"


def run_directory(root: str, durable: str) -> str:
    """The run's own folder under ``root``: named after the durable directory, so runs never mix."""
    key = hashlib.sha256(durable.encode()).hexdigest()[:16]
    return os.path.join(root, "vertexrt-fast", key)

"""One local directory of committed fast steps: written in a temp directory and renamed (the commit).

A step directory is the durable tier's format (``manifest.json`` + checksummed data files), so reading one
verifies every byte. Only steps whose manifest parses and whose files have the sizes it names are listed;
a temp directory (a save cut short) is never a step. The newest :data:`~.config.KEEP` steps are kept.

Example:
    >>> steps = LocalSteps("/dev/shm/vertexrt-fast/<run>/rank_0/own")
    >>> steps.write(10, tree, nodes, buffers, world_size=4)
    >>> steps.valid_steps(world_size=4)
    [5, 10]
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable, Sequence
from typing import Any

from vertexrt.checkpoint import datafiles, restoring, storage, tokens
from vertexrt.checkpoint import manifest as manifest_format
from vertexrt.checkpoint.tiers.config import KEEP
from vertexrt.errors import CheckpointCorruptError, CheckpointError

log = logging.getLogger(__name__)


class LocalSteps:
    """The committed fast steps of one rank's state (its own, or a copy held for a peer) in ``directory``."""

    def __init__(self, directory: str, keep: int = KEEP) -> None:
        self.directory = directory
        self.keep = keep
        self.strategy = storage.strategy_for(directory)
        self.strategy.cleanup()  # temp directories of writers that died

    def write(
        self, step: int, tree: Any, nodes: list[dict[str, Any]], buffers: Sequence[Any], *, world_size: int
    ) -> int:
        """Write and commit ``step`` (replacing an older version of it); returns the bytes written."""
        strategy = self.strategy
        token = tokens.new_token()
        write_dir = strategy.begin(step, token)
        prefix = f"data.{token}.s0"
        try:
            total = sum(len(b) for b in buffers)
            files = datafiles.write(
                strategy.store,
                write_dir,
                prefix,
                nodes,
                buffers,
                part_size=strategy.part_size_for(total),
                threads=strategy.io_threads,
            )
            body = {"shard": 0, "prefix": prefix, "files": files, "tree": tree}
            manifest = manifest_format.build(
                step=step, world_size=world_size, sharded=False, shards=[body], metrics={}
            )
            strategy.commit(step, write_dir, manifest_format.dumps(manifest), token, overwrite=True)
        except BaseException:
            strategy.abort(write_dir, token)
            raise
        self.prune()
        return sum(files.values())

    def receive(self, step: int, manifest: bytes, files: Iterable[tuple[str, Any]]) -> None:
        """Commit ``step`` from a copy's manifest bytes and ``(name, bytes)`` files (checked when read)."""
        strategy = self.strategy
        token = tokens.new_token()
        write_dir = strategy.begin(step, token)
        try:
            for name, data in files:
                strategy.store.write_file(strategy.store.join(write_dir, name), [data])
            strategy.commit(step, write_dir, manifest, token, overwrite=True)
        except BaseException:
            strategy.abort(write_dir, token)
            raise
        self.prune()

    def export(self, step: int) -> tuple[bytes, list[tuple[str, int]]]:
        """``(manifest bytes, [(file name, size)])`` of committed ``step``, to send a copy."""
        data = self.strategy.read_manifest(step)
        name = self.strategy.store.join(self.strategy.step_dir(step), storage.MANIFEST)
        sizes = manifest_format.referenced_sizes(manifest_format.parse(data, name=name, step=step))
        return data, sorted(sizes.items())

    def file(self, step: int, name: str, size: int) -> Any:
        """A data file of ``step`` as a 1-D uint8 array (a private memory map)."""
        return self.strategy.store.map(self.strategy.store.join(self.strategy.step_dir(step), name), size)

    def valid_steps(self, *, world_size: int) -> list[int]:
        """Committed steps, oldest first, whose manifest parses, names this world size and whose data files
        are all present with their sizes (a damaged one is logged and left out)."""
        steps = []
        for step in self.strategy.committed_steps():
            try:
                manifest = restoring.read_manifest(self.strategy, step)
                restoring.check_files(self.strategy, step, manifest)
            except CheckpointCorruptError as exc:
                log.warning("fast checkpoint step %d in %s is unusable: %s", step, self.directory, exc)
                continue
            if manifest["world_size"] == world_size:
                steps.append(step)
        return steps

    def load(self, step: int, *, rank: int, world_size: int, allow_pickle: bool) -> restoring.Loaded:
        """Read and checksum ``step`` (CheckpointCorruptError when damaged)."""
        return restoring.load(
            self.strategy, step, rank=rank, world_size=world_size, shard=None, allow_pickle=allow_pickle
        )

    def remove(self, step: int) -> None:
        self.strategy.delete(step, tokens.new_token())

    def drop_newer(self, step: int) -> None:
        """Delete the steps after ``step`` (another timeline once training resumed from ``step``)."""
        for newer in self.strategy.committed_steps():
            if newer > step:
                self.remove(newer)

    def prune(self) -> None:
        steps = self.strategy.committed_steps()
        for old in steps[: max(0, len(steps) - self.keep)]:
            self.remove(old)


def check_name(name: str, where: str) -> str:
    """A data file name received from a peer: a plain name inside the step directory."""
    if not name or name != os.path.basename(name) or name in (".", "..") or name == storage.MANIFEST:
        raise CheckpointError(f"{where}: a peer sent the file name {name!r}, which is not a data file name")
    return name

"""One committed step restored into several sub-trees at once (the Trainer's restore), rank 0 reading for all.

Rank 0 alone reads the step's manifest and lists its files; each rank receives the header and the bodies of
its own parts (one object gather, one scatter), then reads and checksums their data: O(1) storage requests
for metadata on every rank other than 0. A failure found on rank 0 is the same typed error on every rank.

Example:
    >>> trees = restore(site, 1200, [(replicated, 0), (local, None)], allow_pickle=False)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from vertexrt.checkpoint import dcp, restoring
from vertexrt.checkpoint.step_writer import Site
from vertexrt.distributed import collectives
from vertexrt.errors import CheckpointCorruptError, CheckpointError


def restore(
    site: Site, step: int, parts: Sequence[tuple[Any, int | None]], *, allow_pickle: bool, device: Any = None
) -> list[Any]:
    """Load ``step`` of ``site`` into each ``(target, shard)`` of ``parts`` (shard None: this rank's, or the
    one body of a replicated step); the decoded trees, in order. Every rank calls it together.

    Raises:
        CheckpointCorruptError: the step is damaged (on every rank when rank 0 found it so).
        CheckpointError: a sharded step written by another number of ranks, a newer format, a step
            written through DCP, or reading failed on rank 0.
    """
    dist = collectives.torch_dist() if site.world_size > 1 else None
    wanted = [site.rank if shard is None else shard for _, shard in parts]
    everyone = collectives.gather(wanted, dist)
    offer = collectives.scatter(_offers(site, step, everyone) if everyone is not None else None, dist)
    if offer[0] == "damaged":
        raise CheckpointCorruptError(offer[1])
    if offer[0] == "fatal":
        raise CheckpointError(offer[1])
    _, header, bodies = offer
    strategy = site.strategy
    loaded = [  # a body file of format version 2 is read here, by the rank that needs it (one request)
        restoring.verify(
            strategy,
            step,
            header,
            restoring.read_body(strategy, step, header, entry),
            allow_pickle=allow_pickle,
        )
        for entry in bodies
    ]
    return [restoring.decode(one, target, device) for one, (target, _) in zip(loaded, parts, strict=True)]


def _offers(site: Site, step: int, wanted: list[list[int]]) -> list[tuple[Any, ...]]:
    """Rank 0's side: one message per rank, the header and the bodies of ``wanted[rank]`` (an error is
    every rank's)."""
    strategy = site.strategy
    try:
        manifest = restoring.read_manifest(strategy, step)
        if dcp.written_here(manifest):
            raise CheckpointError(
                f"checkpoint step {step} in {site.directory} was written through DCP (sharded modules) "
                "and this state holds none: restore it with the sharded modules it was saved from"
            )
        bodies = [
            [
                restoring.body_for(strategy, step, manifest, world_size=site.world_size, shard=s)
                for s in shards
            ]
            for shards in wanted
        ]
        restoring.check_files(strategy, step, manifest)
    except CheckpointCorruptError as exc:
        return [("damaged", str(exc))] * len(wanted)
    except CheckpointError as exc:
        return [("fatal", str(exc))] * len(wanted)
    except Exception as exc:  # e.g. EIO on a FUSE mount: every rank stops, none is left waiting
        why = f"reading checkpoint step {step} in {site.directory} failed: {type(exc).__name__}: {exc}"
        return [("fatal", why)] * len(wanted)
    header = restoring.header_of(manifest)
    return [("load", header, mine) for mine in bodies]

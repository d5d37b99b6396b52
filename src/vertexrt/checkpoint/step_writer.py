"""One step's write, for the manager and for DCP alike: shards -> gather -> manifest -> commit -> verdict.

1. Every writing rank writes its data files (:func:`write_shard`) and describes them in a body (prefix,
   file sizes, tree); in a sharded save each rank writes its body beside its data (:func:`write_body`) and
   keeps only a small reference to it (name, size, CRC32C).
2. :func:`gather_shards`: the references (or bodies, or each rank's failure) go to rank 0 over the process
   group, one object gather; nothing is written to or polled from storage as a rendezvous.
3. :func:`commit`: rank 0 builds the manifest (a step header of references: format version 2) and commits it
   through the storage strategy (the manifest, or the rename, is the commit: no partially visible step).
4. :func:`tell_outcome`: rank 0's verdict (committed, or why not) reaches every rank with one broadcast, so a
   failure on any rank is the same typed error on every rank.

A save's token and whether its step exists already are rank 0's decision, sent with one broadcast
(:func:`agree_to_start`): no other rank asks storage. The manager's side of a save is :class:`Site`.

Example:
    >>> token = agree_to_start(site, step, overwrite=False, dist=dist)         # every rank
    >>> body = write_shard(site, step, token, shard=rank, nodes=nodes, buffers=buffers)
    >>> bodies = gather_shards(site, body, None, dist=dist, group=group)      # rank 0: every body
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NoReturn

from vertexrt.checkpoint import datafiles, storage, tokens
from vertexrt.checkpoint import manifest as manifest_format
from vertexrt.distributed import collectives
from vertexrt.errors import CheckpointCorruptError, CheckpointError, StepExistsError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Site:
    """What a step writer (and DCP) needs of a :class:`~vertexrt.checkpoint.CheckpointManager`.

    ``committed(step, token, manifest, replaced)`` runs on rank 0 after a commit: the manager retires the
    files of a version an overwrite replaced and applies its keep policy (deleting in the background).
    """

    directory: str
    strategy: storage.Strategy
    rank: int
    world_size: int
    committed: Callable[[int, str, dict[str, Any], bytes | None], None]


def agree_to_start(site: Site, step: int, *, overwrite: bool, dist: Any) -> str:
    """The save's token, from rank 0 with rank 0's answer to "is ``step`` committed?" (one broadcast).

    Raises:
        StepExistsError: on every rank, when ``step`` is committed and ``overwrite`` is False.
    """
    exists = site.rank == 0 and not overwrite and site.strategy.is_committed(step)
    token, exists = collectives.broadcast((tokens.new_token(), exists), dist)
    if exists:
        raise StepExistsError(
            f"step {step} is already committed in {site.directory}; pass overwrite=True to save(...) to "
            "replace it atomically, or save a new step number"
        )
    return str(token)


def write_shard(
    site: Site,
    write_dir: str,
    token: str,
    shard: int,
    nodes: list[dict[str, Any]],
    buffers: list[Any],
    tree: Any,
) -> dict[str, Any]:
    """Write one shard's data files into ``write_dir``; its manifest body (``shard``, prefix, files, tree)."""
    strategy = site.strategy
    prefix = f"data.{token}.s{shard}"
    files = datafiles.write(
        strategy.store,
        write_dir,
        prefix,
        nodes,
        buffers,
        part_size=strategy.part_size_for(sum(len(b) for b in buffers)),
        threads=strategy.io_threads,
    )
    return {"shard": shard, "prefix": prefix, "files": files, "tree": tree}


def write_body(site: Site, write_dir: str, body: dict[str, Any]) -> dict[str, Any]:
    """Write ``body`` to its own file in ``write_dir``; the step header's reference to it."""
    data = manifest_format.dumps(body)
    path = site.strategy.store.join(write_dir, manifest_format.body_name(body["prefix"]))
    site.strategy.store.write_file(path, [data])
    return manifest_format.reference(body, data)


def gather_shards(
    site: Site, body: dict[str, Any] | None, error: BaseException | None, *, dist: Any, group: Any = None
) -> list[dict[str, Any]] | None:
    """Every rank's body on rank 0 (None elsewhere); every rank calls it, a failed one with its ``error``.

    Raises:
        CheckpointError: on rank 0, naming each rank whose shard failed.
    """
    sent = {"body": body} if error is None else {"error": describe(error)}
    everyone = collectives.gather(sent, dist, group=group)
    if everyone is None:
        return None
    failed = [f"rank {r}: {got['error']}" for r, got in enumerate(everyone) if "error" in got]
    if failed:
        raise CheckpointError(f"writing the shards in {site.directory} failed on " + "; ".join(failed))
    return [got["body"] for got in everyone]


def commit(
    site: Site,
    step: int,
    write_dir: str,
    token: str,
    *,
    bodies: list[dict[str, Any]],
    sharded: bool,
    metrics: dict[str, float],
    overwrite: bool,
    extra: dict[str, Any] | None = None,
) -> tuple[dict[str, Any], bytes | None]:
    """Build the manifest of ``bodies`` (plus ``extra`` fields) and commit it; (manifest, replaced one)."""
    manifest = manifest_format.build(
        step=step, world_size=site.world_size, sharded=sharded, shards=bodies, metrics=metrics
    )
    manifest.update(extra or {})
    replaced = site.strategy.commit(step, write_dir, manifest_format.dumps(manifest), token, overwrite)
    return manifest, replaced


def tell_outcome(error: BaseException | None, *, dist: Any, group: Any = None) -> None:
    """Rank 0's verdict on every rank (one broadcast): returns when the step committed, else raises.

    Rank 0 passes its ``error`` (None: committed); the others pass None and receive rank 0's.

    Raises:
        StepExistsError, CheckpointCorruptError, CheckpointError: what failed, on every rank.
    """
    verdict = None if error is None else (_kind(error), describe(error))
    verdict = collectives.broadcast(verdict, dist, group=group)
    if verdict is None:
        return
    if error is not None:
        raise error
    kind, text = verdict
    raise {"exists": StepExistsError, "corrupt": CheckpointCorruptError}.get(kind, CheckpointError)(text)


def write(
    site: Site,
    step: int,
    token: str,
    *,
    shard: int | None,
    nodes: list[dict[str, Any]],
    buffers: list[Any],
    tree: Any,
    metrics: dict[str, float],
    overwrite: bool,
    dist: Any,
    group: Any = None,
) -> dict[str, Any] | None:
    """The whole sequence for one step: replicated (``shard=None``: rank 0 alone) or one shard per rank.

    Returns the committed manifest on rank 0 (None elsewhere). A failure anywhere removes this save's
    files and raises a :class:`CheckpointError` on every writing rank; earlier steps are untouched.
    """
    strategy = site.strategy
    write_dir = strategy.begin(step, token)
    together = shard is not None
    body: dict[str, Any] | None = None
    error: BaseException | None = None
    try:
        body = write_shard(site, write_dir, token, shard or 0, nodes, buffers, tree)
        if together:
            body = write_body(site, write_dir, body)
    except BaseException as exc:
        if not together or not isinstance(exc, Exception):
            _abort(strategy, write_dir, token)
            _raise_typed(exc, step, site.directory)
        error = exc
    manifest: dict[str, Any] | None = None
    replaced: bytes | None = None
    outcome: BaseException | None = None
    try:
        bodies = gather_shards(site, body, error, dist=dist, group=group) if together else _one(body)
        if bodies is not None:
            manifest, replaced = commit(
                site,
                step,
                write_dir,
                token,
                bodies=bodies,
                sharded=together,
                metrics=metrics,
                overwrite=overwrite,
            )
    except Exception as exc:
        outcome = exc
    if outcome is not None and site.rank == 0:
        _abort(strategy, write_dir, token)
    try:
        if together:
            tell_outcome(outcome if site.rank == 0 else None, dist=dist, group=group)
        elif outcome is not None:
            raise outcome
    except BaseException as exc:
        _raise_typed(exc, step, site.directory)
    if manifest is not None:
        site.committed(step, token, manifest, replaced)
    return manifest


def describe(error: BaseException) -> str:
    """``error`` in one bounded line: its type (when not a CheckpointError) and message."""
    text = str(error) if isinstance(error, CheckpointError) else f"{type(error).__name__}: {error}"
    return text[:1000]


def _kind(error: BaseException) -> str:
    if isinstance(error, StepExistsError):
        return "exists"
    return "corrupt" if isinstance(error, CheckpointCorruptError) else "error"


def _one(body: dict[str, Any] | None) -> list[dict[str, Any]]:
    assert body is not None  # a replicated write that failed has raised already
    return [body]


def _raise_typed(exc: BaseException, step: int, directory: str) -> NoReturn:
    """Re-raise ``exc`` (from inside its ``except``): a CheckpointError as it is, other errors wrapped."""
    if isinstance(exc, CheckpointError) or not isinstance(exc, Exception):
        raise exc
    raise CheckpointError(
        f"saving step {step} to {directory} failed: {exc}. Earlier checkpoints are untouched; "
        "check free space / permissions of the checkpoint directory"
    ) from exc


def _abort(strategy: storage.Strategy, write_dir: str, token: str) -> None:
    try:
        strategy.abort(write_dir, token)
    except Exception as exc:
        log.debug("cleanup after a failed save: %s", exc)

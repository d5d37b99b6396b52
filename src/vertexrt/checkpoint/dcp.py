"""Sharded state (FSDP2 / DTensor) through torch.distributed.checkpoint, on vertexrt's storage and commit.

DCP plans who writes which shard and how a shard maps onto a different mesh; vertexrt stores the bytes:
every rank writes its items into part files of the step (CRC32C per chunk, parallel uploads, the strategy's
part size), and rank 0, once every rank's files are written, commits the step with a manifest that holds
DCP's metadata as JSON (:mod:`~vertexrt.checkpoint.dcp_metadata`: no pickle is read back from storage).
Retention, fallback to an earlier step and the step's atomic commit are the
:class:`~vertexrt.checkpoint.CheckpointManager`'s, which routes here when the state holds DTensors (or the
step was written here) and which this module sees as a :class:`~vertexrt.checkpoint.step_writer.Site`;
the write is the step writer's (shards, gather, commit), through DCP's storage plugin
(:mod:`~vertexrt.checkpoint.dcp_storage`).

Restoring onto another world size or mesh (2 ranks -> 3, 2 -> 1) is DCP's resharding: modules and
optimizers in the target are loaded through ``get_state_dict`` / ``set_state_dict``.

Example:
    >>> fully_shard(model)                                   # FSDP2, every rank
    >>> mgr = CheckpointManager("gs://bucket/run/ckpt")
    >>> mgr.save(step, {"model": model, "optim": opt, "step": step})
    >>> restored = mgr.restore({"model": model, "optim": opt, "step": 0})   # any world size
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from vertexrt import audit
from vertexrt.checkpoint import restoring, step_writer
from vertexrt.checkpoint.dcp_metadata import KEY, decode_metadata
from vertexrt.checkpoint.dcp_storage import manifest_name, reader_class, safe_planner, writer_class
from vertexrt.checkpoint.step_writer import Site
from vertexrt.distributed import collectives
from vertexrt.errors import CheckpointCorruptError, CheckpointError

log = logging.getLogger(__name__)

# -- routing ---------------------------------------------------------------------------------------------


def holds_dtensors(state: Any) -> bool:
    """True when ``state`` (a dict tree) holds a DTensor: a leaf, a module's or an optimizer's parameter."""
    import sys

    if "torch.distributed.tensor" not in sys.modules:  # no DTensor can exist yet; importing it costs seconds
        return False
    import torch
    from torch.distributed.tensor import DTensor

    stack = [state]
    while stack:
        value = stack.pop()
        if isinstance(value, DTensor):
            return True
        if isinstance(value, torch.nn.Module):
            if any(isinstance(p, DTensor) for p in value.parameters()):
                return True
        elif isinstance(value, torch.optim.Optimizer):
            if any(isinstance(p, DTensor) for g in value.param_groups for p in g["params"]):
                return True
        elif isinstance(value, Mapping):
            stack.extend(value.values())
        elif isinstance(value, (list, tuple)):
            stack.extend(value)
    return False


def written_here(manifest: Mapping[str, Any]) -> bool:
    """True when a parsed manifest is of a step written by :func:`save`."""
    return KEY in manifest


@dataclass(frozen=True)
class Restored:
    """What :func:`restore` loaded: the step and the state tree."""

    step: int
    value: Any


# -- state <-> DCP state dict ----------------------------------------------------------------------------


def _to_state_dict(state: Any, what: str) -> tuple[dict[str, Any], list[tuple[str, Any, str | None, Any]]]:
    """DCP's state dict for ``state`` and the (key, module, optimizer key, optimizer) pairs in it."""
    import torch
    from torch.distributed.checkpoint.state_dict import get_state_dict

    if not isinstance(state, Mapping):
        raise CheckpointError(
            f"sharded (DTensor) {what} must be a dict such as {{'model': model, 'optim': opt, 'step': n}}, "
            f"not a {type(state).__name__}"
        )
    modules = {k: v for k, v in state.items() if isinstance(v, torch.nn.Module)}
    optims = {k: v for k, v in state.items() if isinstance(v, torch.optim.Optimizer)}
    owner: dict[str, str] = {}
    for okey, opt in optims.items():
        ids = {id(p) for g in opt.param_groups for p in g["params"]}
        found = [m for m, mod in modules.items() if ids <= {id(p) for p in mod.parameters()}]
        if not found:
            raise CheckpointError(
                f"{what}[{okey!r}] optimizes parameters of no module in the {what}: put the module it "
                f"trains beside it (e.g. {{'model': model, {okey!r}: optimizer}})"
            )
        owner[okey] = found[0]
    pairs = []
    out: dict[str, Any] = {k: v for k, v in state.items() if k not in modules and k not in optims}
    for mkey, module in modules.items():
        okeys = [o for o, m in owner.items() if m == mkey]
        opts = [optims[o] for o in okeys]
        model_sd, optim_sd = get_state_dict(module, opts)
        out[mkey] = model_sd
        if okeys:
            if len(okeys) > 1:
                raise CheckpointError(
                    f"{what} has optimizers {okeys} for one module {mkey!r}: save one optimizer per module"
                )
            out[okeys[0]] = optim_sd
        pairs.append((mkey, module, okeys[0] if okeys else None, opts[0] if opts else None))
    return out, pairs


def _check_group(site: Site, state: Any, what: str) -> Any:
    dist = collectives.torch_dist()
    if dist is None and (site.world_size > 1 or holds_dtensors(state)):
        raise CheckpointError(
            f"{what} of sharded (DTensor) state in {site.directory} needs torch.distributed initialised on "
            f"every rank (world size {site.world_size}): call vertexrt.distributed.init_torch() (or "
            "torch.distributed.init_process_group) before it, and keep the group until the manager is closed"
        )
    return dist


# -- saving ----------------------------------------------------------------------------------------------


def save(site: Site, step: int, state: Any, metrics: dict[str, float], overwrite: bool) -> None:
    """Write ``state`` as ``step`` through DCP; every rank calls it; returns once the step is committed."""
    import torch.distributed.checkpoint as tdcp
    from torch.distributed.checkpoint.api import CheckpointException

    dist = _check_group(site, state, "save()")
    strategy = site.strategy
    token = step_writer.agree_to_start(site, step, overwrite=overwrite, dist=dist)
    state_dict, _ = _to_state_dict(state, "state")
    audit.event("save", step=step, asynchronous=False)
    write_dir = strategy.begin(step, token)
    writer = writer_class()(site, step, write_dir, token, metrics, overwrite)
    try:
        tdcp.save(state_dict, storage_writer=writer)
    except BaseException as exc:
        if site.rank == 0:
            try:
                strategy.abort(write_dir, token)
            except Exception as cleanup:
                log.debug("cleanup after a failed sharded save: %s", cleanup)
        if isinstance(exc, CheckpointError) or not isinstance(exc, (Exception, CheckpointException)):
            raise
        raise CheckpointError(
            f"saving sharded step {step} to {site.directory} failed: {_unwrap(exc)}. Earlier checkpoints are "
            "untouched; check free space / permissions of the checkpoint directory"
        ) from exc
    if site.rank == 0:
        site.committed(step, token, writer.manifest, writer.replaced)
    log.info("sharded checkpoint step %d committed in %s", step, site.directory)
    audit.event("commit", step=step)


# -- restoring -------------------------------------------------------------------------------------------


def restore(site: Site, target: Any, step: int | None) -> Restored | None:
    """Load the newest valid DCP step (or ``step``) into ``target``; every rank calls it; None if none.

    Rank 0 lists the steps and reads each candidate's manifest once; the others receive it (one broadcast).
    A step that is corrupt on any rank (a checksum, a missing file) is skipped on every rank and the
    previous one is tried (not when ``step`` is given).
    """
    if target is None:
        raise CheckpointError(
            f"the newest checkpoint in {site.directory} holds sharded (DCP) state: restore it into a target, "
            "e.g. restore({'model': model, 'optim': opt, 'step': 0})"
        )
    dist = _check_group(site, target, "restore()")
    candidates: list[int] | None = [step] if step is not None else None
    if candidates is None and site.rank == 0:
        candidates = list(reversed(site.strategy.committed_steps()))
    candidates = collectives.broadcast(candidates, dist)
    failures = []
    for s in candidates or []:
        try:
            result = _load_step(site, s, target, dist)
        except CheckpointCorruptError as exc:
            if step is not None:
                raise
            log.warning("skipping sharded checkpoint step %d in %s, falling back: %s", s, site.directory, exc)
            failures.append(f"step {s}: {exc}")
            continue
        audit.event("resume", step=s)
        return Restored(s, result)
    if failures:
        raise CheckpointError(
            f"no usable checkpoint in {site.directory}: "
            + "; ".join(failures)
            + ". Delete the directory to start over, or restore(step=...) a specific step"
        )
    return None


def _load_step(site: Site, step: int, target: Any, dist: Any) -> Any:
    import torch.distributed.checkpoint as tdcp
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.state_dict import set_state_dict

    manifest, metadata, problem = None, None, None
    try:  # rank 0 reads, parses and checks the manifest once; every rank needs all of DCP's metadata
        if site.rank == 0:
            manifest = restoring.read_manifest(site.strategy, step)
            if not written_here(manifest):
                raise CheckpointError(
                    f"checkpoint step {step} in {site.directory} was not saved with sharded (DTensor) state: "
                    "restore it into a target without DTensors, or restore(step=...) a sharded step"
                )
            restoring.check_files(site.strategy, step, manifest)
    except Exception as exc:  # any error: every rank must reach the agreement, or the others hang in DCP
        problem = exc
    manifest = collectives.broadcast(manifest if problem is None else None, dist)  # None: rank 0 failed
    if manifest is not None:
        try:
            metadata = decode_metadata(manifest[KEY], manifest, name=manifest_name(site, step))
        except Exception as exc:
            problem = exc
    agree(problem, dist, f"reading checkpoint step {step} in {site.directory}")
    assert manifest is not None
    state_dict, pairs = _to_state_dict(target, "target")
    reader = reader_class()(site, step, manifest, metadata)
    try:
        tdcp.load(state_dict, storage_reader=reader, planner=safe_planner())
    except CheckpointException as exc:
        errors = [_unwrap_one(e) for e in exc.failures.values()]
        if errors and all(isinstance(e, CheckpointCorruptError) for e in errors):
            raise CheckpointCorruptError("; ".join(str(e) for e in errors)) from exc
        raise CheckpointError(
            f"restoring sharded step {step} from {site.directory} failed: {_unwrap(exc)}"
        ) from exc
    result = dict(state_dict)
    for mkey, module, okey, opt in pairs:
        set_state_dict(
            module,
            [opt] if opt is not None else [],
            model_state_dict=state_dict[mkey],
            optim_state_dict=state_dict[okey] if okey is not None else {},
        )
        result[mkey] = module
        if okey is not None:
            result[okey] = opt
    return result


def agree(error: BaseException | None, dist: Any, what: str) -> None:
    """Raise on every rank when ``what`` failed on any rank (one all-gather), so all ranks take one path.

    All failures damaged steps: CheckpointCorruptError everywhere (so every rank falls back alike), this
    rank's own when it has one. Else the same CheckpointError on every rank, naming each failing rank's error.

    Example:
        >>> agree(None, None, "reading checkpoint step 3")  # no failure anywhere: returns
    """
    mine = None if error is None else (isinstance(error, CheckpointCorruptError), step_writer.describe(error))
    outcomes = collectives.all_gather(mine, dist)
    failed = [(rank, outcome) for rank, outcome in enumerate(outcomes) if outcome is not None]
    if not failed:
        return
    message = f"{what} failed on " + "; ".join(f"rank {rank}: {text}" for rank, (_, text) in failed)
    if all(corrupt for _, (corrupt, _) in failed):
        if isinstance(error, CheckpointCorruptError):
            raise error
        raise CheckpointCorruptError(message)
    raise CheckpointError(message) from error


def _unwrap_one(failure: Any) -> BaseException:
    """The exception of one rank's failure in a ``CheckpointException`` (an exception or a (exc, tb) pair)."""
    if isinstance(failure, BaseException):
        return failure
    if isinstance(failure, tuple) and failure and isinstance(failure[0], BaseException):
        return failure[0]
    return RuntimeError(str(failure))


def _unwrap(exc: BaseException) -> str:
    failures = getattr(exc, "failures", None)
    if isinstance(failures, dict) and failures:
        return "; ".join(f"rank {r}: {_unwrap_one(f)}" for r, f in sorted(failures.items()))
    return str(exc)

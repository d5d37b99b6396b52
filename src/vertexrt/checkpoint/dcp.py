"""Sharded state (FSDP2 / DTensor) through torch.distributed.checkpoint, on vertexrt's storage and commit.

DCP plans who writes which shard and how a shard maps onto a different mesh; vertexrt stores the bytes:
every rank writes its items into part files of the step (CRC32C per chunk, parallel uploads, the strategy's
part size), and rank 0, once every rank's files are written, commits the step with a manifest that holds
DCP's metadata as JSON (:mod:`~vertexrt.checkpoint.dcp_metadata`: no pickle is read back from storage).
Retention, fallback to an earlier step and the step's atomic commit are the
:class:`~vertexrt.checkpoint.CheckpointManager`'s, which routes here when the state holds DTensors (or the
step was written here) and which this module sees as a :class:`~vertexrt.checkpoint.step_writer.Site`;
the write is the step writer's (shards, gather, commit).

Restoring onto another world size or mesh (2 ranks -> 3, 2 -> 1) is DCP's resharding: modules and
optimizers in the target are loaded through ``get_state_dict`` / ``set_state_dict``.

Example:
    >>> fully_shard(model)                                   # FSDP2, every rank
    >>> mgr = CheckpointManager("gs://bucket/run/ckpt")
    >>> mgr.save(step, {"model": model, "optim": opt, "step": step})
    >>> restored = mgr.restore({"model": model, "optim": opt, "step": 0})   # any world size
"""

from __future__ import annotations

import io
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from vertexrt import audit
from vertexrt.checkpoint import datafiles, restoring, step_writer, storage
from vertexrt.checkpoint.dcp_metadata import decode_metadata, encode_metadata
from vertexrt.checkpoint.step_writer import Site
from vertexrt.distributed import collectives
from vertexrt.errors import CheckpointCorruptError, CheckpointError

log = logging.getLogger(__name__)

#: The manifest key that marks a step written through DCP (and holds its metadata).
KEY = "dcp"


# -- routing ---------------------------------------------------------------------------------------------


def holds_dtensors(state: Any) -> bool:
    """True when ``state`` (a dict tree) holds a DTensor: a leaf, a module's or an optimizer's parameter."""
    import sys

    if "torch" not in sys.modules:
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
    writer = _writer_class()(site, step, write_dir, token, metrics, overwrite)
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


def _tensor_bytes(tensor: Any) -> Any:
    """The bytes of a tensor (any device, view or not, lazily conjugated or not) as a 1-D uint8 array."""
    flat = tensor.detach().resolve_conj().resolve_neg().cpu().contiguous().reshape(-1)
    return flat.view(__import__("torch").uint8).numpy()


def _writer_class() -> type:
    """DCP's ``StorageWriter`` over one step of a vertexrt strategy (defined when torch is imported)."""
    from torch.distributed.checkpoint import StorageWriter
    from torch.distributed.checkpoint.planner import WriteItemType
    from torch.distributed.checkpoint.storage import WriteResult
    from torch.futures import Future

    class Writer(StorageWriter):
        def __init__(
            self,
            site: Site,
            step: int,
            write_dir: str,
            token: str,
            metrics: dict[str, float],
            overwrite: bool,
        ) -> None:
            self.site, self.step, self.write_dir, self.token = site, step, write_dir, token
            self.metrics, self.overwrite = metrics, overwrite
            self.replaced: bytes | None = None
            self.manifest: dict[str, Any] = {}
            self.bodies: list[dict[str, Any]] | None = None  # rank 0: every rank's body, gathered
            self.rank = 0

        def reset(self, checkpoint_id: Any = None) -> None:
            pass

        def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
            self.rank = self.site.rank

        def prepare_local_plan(self, plan: Any) -> Any:
            return plan

        def prepare_global_plan(self, plans: list[Any]) -> list[Any]:
            return plans

        def write_data(self, plan: Any, planner: Any) -> Any:
            buffers: list[Any] = []
            nodes: list[dict[str, Any]] = []
            described: list[dict[str, Any]] = []
            for item in plan.items:
                data = planner.resolve_data(item)
                if item.type == WriteItemType.BYTE_IO:
                    buffers.append(__import__("numpy").frombuffer(data.getvalue(), dtype="uint8"))
                    described.append({"t": "bytes"})
                else:
                    buffers.append(_tensor_bytes(data))
                    described.append(
                        {
                            "t": "tensor",
                            "dtype": str(data.dtype).removeprefix("torch."),
                            "shape": list(data.shape),
                        }
                    )
                offset = item.index.offset
                nodes.append({"t": "bytes", "of": [item.index.fqn, None if offset is None else list(offset)]})
            body, error = None, None
            try:
                tree = {"t": "list", "v": nodes}
                body = step_writer.write_shard(
                    self.site, self.write_dir, self.token, self.rank, nodes, buffers, tree
                )
            except Exception as exc:  # still in the gather below: every rank reaches it
                error = exc
            self.bodies = step_writer.gather_shards(self.site, body, error, dist=collectives.torch_dist())
            if error is not None:
                raise error
            results = [
                WriteResult(
                    index=item.index,
                    size_in_bytes=len(buf),
                    storage_data={"shard": self.rank, "leaf": i, **d},
                )
                for i, (item, buf, d) in enumerate(zip(plan.items, buffers, described, strict=True))
            ]
            future: Future[list[WriteResult]] = Future()
            future.set_result(results)
            return future

        def finish(self, metadata: Any, results: list[list[Any]]) -> None:
            assert self.bodies is not None  # the coordinator is rank 0, which gathered every body
            metadata.storage_data = {r.index: r.storage_data for rank in results for r in rank}
            self.manifest, self.replaced = step_writer.commit(
                self.site,
                self.step,
                self.write_dir,
                self.token,
                bodies=self.bodies,
                sharded=True,
                metrics=self.metrics,
                overwrite=self.overwrite,
                extra={KEY: encode_metadata(metadata)},
            )

        @classmethod
        def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
            return False

    return Writer


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
            metadata = decode_metadata(manifest[KEY], manifest, name=_manifest_name(site, step))
        except Exception as exc:
            problem = exc
    agree(problem, dist, f"reading checkpoint step {step} in {site.directory}")
    assert manifest is not None
    state_dict, pairs = _to_state_dict(target, "target")
    reader = _reader_class()(site, step, manifest, metadata)
    try:
        tdcp.load(state_dict, storage_reader=reader, planner=_safe_planner())
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


def _manifest_name(site: Site, step: int) -> str:
    return str(site.strategy.store.join(site.strategy.step_dir(step), storage.MANIFEST))


def _safe_planner() -> Any:
    """DCP's default load planner, but non-tensor values are unpickled with ``weights_only=True``."""
    import torch
    from torch.distributed.checkpoint import DefaultLoadPlanner
    from torch.distributed.checkpoint._traverse import set_element

    class SafeLoadPlanner(DefaultLoadPlanner):
        def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
            loaded = torch.load(value, weights_only=True)
            if self.flatten_state_dict:
                set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)
            else:
                self.state_dict[read_item.dest_index.fqn] = loaded

    return SafeLoadPlanner()


def _reader_class() -> type:
    """DCP's ``StorageReader`` over one verified step (defined when torch is imported)."""
    import torch
    from torch.distributed.checkpoint import StorageReader
    from torch.distributed.checkpoint.planner import LoadItemType
    from torch.futures import Future

    class Reader(StorageReader):
        def __init__(self, site: Site, step: int, manifest: dict[str, Any], metadata: Any) -> None:
            self.site, self.step, self.manifest, self.metadata = site, step, manifest, metadata

        def reset(self, checkpoint_id: Any = None) -> None:
            pass

        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            return self.metadata

        def set_up_storage_reader(
            self, metadata: Any, is_coordinator: bool, *args: Any, **kwargs: Any
        ) -> None:
            pass

        def prepare_local_plan(self, plan: Any) -> Any:
            return plan

        def prepare_global_plan(self, plans: list[Any]) -> list[Any]:
            return plans

        def read_data(self, plan: Any, planner: Any) -> Any:
            strategy = self.site.strategy
            name = _manifest_name(self.site, self.step)
            bodies = {b["shard"]: b for b in self.manifest["shards"]}
            wanted: dict[int, dict[int, Any]] = {}
            for req in plan.items:
                where = self.metadata.storage_data.get(req.storage_index)
                if where is None:
                    raise CheckpointCorruptError(
                        f"manifest {name} does not locate {req.storage_index.fqn}", file=name
                    )
                wanted.setdefault(where["shard"], {})[where["leaf"]] = None
            buffers: dict[tuple[int, int], Any] = {}
            for shard, leaves in wanted.items():
                body = bodies[shard]
                nodes = body["tree"]["v"]
                order = sorted(leaves)
                got = datafiles.read(
                    strategy.store,
                    strategy.step_dir(self.step),
                    body["prefix"],
                    body["files"],
                    [nodes[i] for i in order],
                    threads=strategy.io_threads,
                    use_mmap=strategy.mmap_reads,
                )
                buffers.update({(shard, i): buf for i, buf in zip(order, got, strict=True)})
            for req in plan.items:
                where = self.metadata.storage_data[req.storage_index]
                data = buffers[(where["shard"], where["leaf"])]
                if req.type == LoadItemType.BYTE_IO:
                    planner.load_bytes(req, io.BytesIO(bytes(data)))
                    continue
                stored = (
                    torch.frombuffer(bytearray(data), dtype=torch.uint8)
                    if len(data)
                    else torch.empty(0, dtype=torch.uint8)
                )
                stored = stored.view(where["dtype"]).reshape(where["shape"])
                for dim, (offset, length) in enumerate(zip(req.storage_offsets, req.lengths, strict=True)):
                    stored = stored.narrow(dim, offset, length)
                dest = planner.resolve_tensor(req).detach()
                if dest.size() != stored.size():
                    raise CheckpointCorruptError(
                        f"manifest {name}: {req.storage_index.fqn} has shape {list(stored.size())}, "
                        f"the target expects {list(dest.size())}",
                        file=name,
                    )
                dest.copy_(stored)
                planner.commit_tensor(req, dest)
            future: Future[None] = Future()
            future.set_result(None)
            return future

        @classmethod
        def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
            return False

    return Reader


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

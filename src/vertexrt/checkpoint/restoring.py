"""Reading a committed step: validate its manifest, check the world, read and checksum its bytes, decode.

Across ranks, :func:`agree` picks one step for everybody: each rank verifies candidates (newest first) until
one is valid for it, and all-reduces ``(newest valid index, fatal error)`` until every rank holds the same
step. No rank loads anything before the ranks agree.

Example:
    >>> loaded = load(strategy, 1200, rank=0, world_size=1, shard=None, allow_pickle=False)
    >>> state = decode(loaded, target=None)
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from vertexrt.checkpoint import datafiles, serialization
from vertexrt.checkpoint import manifest as fmt
from vertexrt.checkpoint.rng import RngState
from vertexrt.checkpoint.storage import MANIFEST, Strategy
from vertexrt.distributed import collectives
from vertexrt.errors import CheckpointCorruptError, CheckpointError

log = logging.getLogger(__name__)


@dataclass
class Loaded:
    """One verified shard of a step: its parsed manifest and body, leaf nodes and checked leaf bytes."""

    step: int
    manifest: dict[str, Any]
    body: dict[str, Any]
    nodes: list[dict[str, Any]]
    buffers: list[Any]


def read_manifest(strategy: Strategy, step: int) -> dict[str, Any]:
    """The validated manifest of ``step`` (CheckpointCorruptError when it is missing or damaged)."""
    name = strategy.store.join(strategy.step_dir(step), MANIFEST)
    try:
        data = strategy.read_manifest(step)
    except FileNotFoundError:
        raise CheckpointCorruptError(f"manifest {name} disappeared (deleted by another writer?)", file=name)
    return fmt.parse(data, name=name, step=step)


def load(
    strategy: Strategy, step: int, *, rank: int, world_size: int, shard: int | None, allow_pickle: bool
) -> Loaded:
    """Read and verify ``step``'s shard for this rank (all of a replicated step).

    Raises:
        CheckpointCorruptError: anything damaged or missing (the caller may fall back).
        CheckpointError: the world size differs from the one that wrote a sharded step, a newer format,
            or pickled leaves without ``allow_pickle``.
    """
    manifest = read_manifest(strategy, step)
    name = strategy.store.join(strategy.step_dir(step), MANIFEST)
    bodies = manifest["shards"]
    if manifest["sharded"]:
        if manifest["world_size"] != world_size:
            raise CheckpointError(
                f"checkpoint step {step} in {strategy.root} was written by {manifest['world_size']} ranks as "
                f"per-rank shards, but this job has {world_size}: resume with {manifest['world_size']} "
                f"replicas (resharding is not supported), or restore into a manager made with "
                f"world_size={manifest['world_size']}"
            )
        wanted = rank if shard is None else shard
        chosen = [b for b in bodies if b["shard"] == wanted]
        if not chosen:
            raise CheckpointError(
                f"checkpoint step {step} in {strategy.root} has shards "
                f"{sorted(b['shard'] for b in bodies)}, not {wanted}: restore(shard=...) one of them"
            )
        body = chosen[0]
    else:
        body = bodies[0]
    nodes = serialization.leaf_nodes(body["tree"])
    for node in nodes:
        if node["t"] == "pickle" and not allow_pickle:
            raise CheckpointError(
                f"checkpoint step {step} holds a pickled {node.get('type')}; pass allow_pickle=True to "
                "the CheckpointManager if you trust this checkpoint"
            )
        fmt.check_leaf(node, name)
    check_files(strategy, step, manifest)
    buffers = datafiles.read(
        strategy.store,
        strategy.step_dir(step),
        body["prefix"],
        body["files"],
        nodes,
        threads=strategy.io_threads,
        use_mmap=strategy.mmap_reads,
    )
    return Loaded(step, manifest, body, nodes, buffers)


def check_files(strategy: Strategy, step: int, manifest: dict[str, Any]) -> None:
    """Every data file the manifest names is present, a plain file, of the size it says."""
    directory = strategy.step_dir(step)
    present = {e.name: e for e in strategy.store.listdir(directory)}
    for name, size in fmt.referenced_sizes(manifest).items():
        entry = present.get(name)
        if entry is None or entry.is_dir or entry.size != size:
            path = strategy.store.join(directory, name)
            what = "is missing" if entry is None else f"is not a file of {size} bytes"
            raise CheckpointCorruptError(f"data file {path} {what}", file=path)


def decode(loaded: Loaded, target: Any, device: Any = None) -> Any:
    """The state tree of a verified step; loaded into ``target``'s live objects when given.

    Torch leaves that are model or optimizer data go to ``device`` when given; else, without ``target``, to
    the GPU they were saved from, as seen from this process (:func:`saved_cuda_index`; CPU, with a warning,
    on a machine without CUDA). RNG states and optimizer step counters stay on the CPU (:func:`moves`). Live
    CUDA targets are filled through pinned bounce buffers, each copy queued on the current stream before the
    target is read.

    Raises:
        CheckpointError: ``device`` is not a device of this machine.
    """
    from vertexrt.checkpoint import adapters, staging

    by_node = {id(node): buffer for node, buffer in zip(loaded.nodes, loaded.buffers, strict=True)}
    places = serialization.leaf_places(loaded.body["tree"])
    recorded = (_cuda_index(str(node["device"])) for node in loaded.nodes if node.get("device"))
    saved = {index for index in recorded if index is not None}
    placement = _Placement(device, follow_saved=target is None, step=loaded.step, saved_indices=saved)

    def values(node: dict[str, Any]) -> Any:
        return adapters.value(node["t"], node, by_node[id(node)])

    def place(node: dict[str, Any], value: Any) -> Any:
        if node["t"] != "torch" or not moves(*places[id(node)], value):
            return value
        return placement(node, value)

    with staging.uploads():
        if target is None:
            return serialization.decode(loaded.body["tree"], values, place=place)
        return serialization.decode(loaded.body["tree"], values, target, place)


#: The class of :func:`vertexrt.checkpoint.rng_state`'s object, as a checkpoint's tree names it.
RNG_STATE_CLASS = f"{RngState.__module__}.{RngState.__qualname__}"


def moves(owner: str | None, keys: tuple[Any, ...], value: Any) -> bool:
    """Whether a restored tensor goes to the asked / saved device: model and optimizer data do; the RNG
    state (a CPU ByteTensor ``torch.set_rng_state`` requires) and an optimizer's ``state[i]['step']``
    counter (torch keeps it where it is given, and a CUDA one costs a GPU sync per parameter per step
    unless the optimizer is fused or capturable, which move it themselves) stay on the CPU."""
    if owner == RNG_STATE_CLASS:
        return False
    is_step = len(keys) >= 3 and keys[-1] == "step" and keys[-3] == "state"
    return not (is_step and getattr(value, "ndim", None) == 0)


def saved_cuda_index(saved: int | None, saved_indices: set[int], current: int, count: int) -> int:
    """The local GPU a tensor saved on ``cuda:saved`` is restored to.

    A process that saved everything on one GPU restores on its current device
    (``torch.cuda.current_device()``): eight processes that each saved from their own ``cuda:k`` each get
    their own device back, not ``cuda:0``. State spread over several GPUs keeps its indices where this
    process sees that many devices, else it goes to the current device.
    """
    if saved is None or len(saved_indices) <= 1 or saved >= count:
        return current
    return saved


class _Placement:
    """Moves restored CPU tensors to the asked (or saved) device."""

    def __init__(self, device: Any, *, follow_saved: bool, step: int, saved_indices: set[int]) -> None:
        self.asked = None if device is None else _device(device, f"restore(device={device!r})")
        self.follow_saved = follow_saved
        self.step = step
        self.saved_indices = saved_indices
        self.warned = False

    def __call__(self, node: dict[str, Any], value: Any) -> Any:
        where = self.asked
        if where is None and self.follow_saved and node.get("device"):
            where = self._saved(str(node["device"]))
        if where is None or where.type == "cpu":
            return value
        import torch

        out = torch.empty(value.shape, dtype=value.dtype, device=where)
        from vertexrt.checkpoint import staging

        if not staging.copy_to_device(value, out):
            out.copy_(value)
        return out

    def _saved(self, recorded: str) -> Any:
        import torch

        try:
            where = torch.device(recorded)
        except (RuntimeError, TypeError):
            where = None
        if where is not None and where.type == "cuda" and torch.cuda.is_available():
            index = saved_cuda_index(
                where.index, self.saved_indices, torch.cuda.current_device(), torch.cuda.device_count()
            )
            return torch.device("cuda", index)
        if not self.warned:
            self.warned = True
            log.warning(
                "checkpoint step %d holds tensors saved on %s, which this machine does not have: they are "
                "restored on the CPU; pass restore(device=...) to choose",
                self.step,
                recorded,
            )
        return None


def _cuda_index(recorded: str) -> int | None:
    """The index of a recorded ``cuda:k`` device (None for a bare ``cuda`` or another device type)."""
    kind, _, index = recorded.partition(":")
    return int(index) if kind == "cuda" and index.isdigit() else None


def _device(device: Any, what: str) -> Any:
    try:
        import torch
    except ImportError:
        raise CheckpointError(f"{what}: placing tensors on a device needs torch") from None
    try:
        where = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise CheckpointError(f"{what}: not a device ({exc}); use e.g. 'cpu', 'cuda' or 'cuda:0'") from None
    if where.type == "cuda":
        if not torch.cuda.is_available():
            raise CheckpointError(
                f"{what}: this machine has no CUDA device (torch.cuda.is_available() is False); "
                "restore with device='cpu', or without device= to get CPU tensors"
            )
        if where.index is not None and where.index >= torch.cuda.device_count():
            raise CheckpointError(
                f"{what}: this machine has {torch.cuda.device_count()} CUDA device(s); pick one of them"
            )
    elif where.type != "cpu":
        raise CheckpointError(f"{what}: only 'cpu' and 'cuda' devices are supported")
    return where


def agree(
    candidates: list[int], verify: Callable[[int], Loaded], dist: Any | None, root: str
) -> tuple[Loaded | None, list[str]]:
    """The newest candidate every rank verified (None if there is none) and this rank's failures.

    ``candidates`` (newest first) must be the same list on every rank; all ranks call this together.
    """
    failures: list[str] = []
    found: Loaded | None = None
    index = 0
    while True:
        local, error = len(candidates), None
        for i in range(index, len(candidates)):
            if found is not None and found.step == candidates[i]:
                local = i
                break
            try:
                found = verify(candidates[i])
            except CheckpointCorruptError as exc:
                log.warning(
                    "skipping checkpoint step %d in %s and falling back to an earlier step: %s",
                    candidates[i],
                    root,
                    exc,
                )
                failures.append(f"step {candidates[i]}: {exc}")
                continue
            except CheckpointError as exc:
                local, error = i, exc
                break
            except Exception as exc:  # e.g. EIO on a FUSE mount: stop every rank, do not leave them waiting
                local, error = i, _unreadable(candidates[i], root, exc)
                break
            local = i
            break
        newest, neg_oldest, fatal = collectives.all_max([local, -local, 1 if error else 0], dist)
        if fatal:
            if error is not None:
                raise error
            raise CheckpointError(
                f"restoring from {root} failed on another rank (see its log); every rank stops here"
            )
        if newest == -neg_oldest:
            if newest >= len(candidates):
                return None, failures
            assert found is not None and found.step == candidates[newest]
            return found, failures
        index = newest


def _unreadable(step: int, root: str, exc: Exception) -> CheckpointError:
    """A typed error for an untyped failure reading ``step`` (all ranks then stop together)."""
    error = CheckpointError(
        f"reading checkpoint step {step} in {root} failed: {type(exc).__name__}: {exc}. "
        "Check the checkpoint storage (mount, permissions, network), then restart the job"
    )
    error.__cause__ = exc
    return error

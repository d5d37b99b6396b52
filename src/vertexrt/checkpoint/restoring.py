"""Reading a committed step: validate its manifest, check the world, read and checksum its bytes, decode.

Across ranks, :func:`newest` picks one step for everybody with O(1) storage requests per rank other than 0:
rank 0 lists the steps, reads and parses each candidate's manifest (a step header) once and checks its files
(one listing); each rank receives only its own shard's entry (one scatter), reads its body file (format
version 2) and checks it against the header, reads and checksums its bytes, and one all-reduce
says whether every rank holds the step; if not, rank 0 offers the previous one. No rank loads anything
before the ranks agree.

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
from vertexrt.checkpoint import manifest as manifest_format
from vertexrt.checkpoint.rng import RngState
from vertexrt.checkpoint.storage import MANIFEST, Strategy
from vertexrt.distributed import collectives
from vertexrt.errors import CheckpointCorruptError, CheckpointError

log = logging.getLogger(__name__)


#: Rounds of re-listing when a restore finds no usable step while writers change the directory.
_RESTORE_ROUNDS = 3


@dataclass
class Loaded:
    """One verified shard of a step: its header (the manifest without shards) and body, leaf nodes and
    checked leaf bytes."""

    step: int
    header: dict[str, Any]
    body: dict[str, Any]
    nodes: list[dict[str, Any]]
    buffers: list[Any]


@dataclass(frozen=True)
class DcpStep:
    """The newest usable step was written through DCP (:mod:`vertexrt.checkpoint.dcp` restores it)."""

    step: int


def read_manifest(strategy: Strategy, step: int) -> dict[str, Any]:
    """The validated manifest of ``step`` (CheckpointCorruptError when it is missing or damaged)."""
    name = strategy.store.join(strategy.step_dir(step), MANIFEST)
    try:
        data = strategy.read_manifest(step)
    except FileNotFoundError:
        raise CheckpointCorruptError(f"manifest {name} disappeared (deleted by another writer?)", file=name)
    return manifest_format.parse(data, name=name, step=step)


def load(
    strategy: Strategy,
    step: int,
    *,
    rank: int,
    world_size: int,
    shard: int | None,
    allow_pickle: bool,
    manifest: dict[str, Any] | None = None,
) -> Loaded:
    """Read and verify ``step``'s shard for this rank (all of a replicated step); ``manifest``: the step's
    parsed manifest when the caller has read it already (it is read here otherwise).

    Raises:
        CheckpointCorruptError: anything damaged or missing (the caller may fall back).
        CheckpointError: the world size differs from the one that wrote a sharded step, a newer format,
            or pickled leaves without ``allow_pickle``.
    """
    if manifest is None:
        manifest = read_manifest(strategy, step)
    entry = body_for(strategy, step, manifest, world_size=world_size, shard=rank if shard is None else shard)
    check_files(strategy, step, manifest)
    header = header_of(manifest)
    return verify(strategy, step, header, read_body(strategy, step, header, entry), allow_pickle=allow_pickle)


def header_of(manifest: dict[str, Any]) -> dict[str, Any]:
    """A parsed manifest without its per-shard bodies (what every rank needs to know of a step)."""
    return {key: value for key, value in manifest.items() if key != "shards"}


def body_for(strategy: Strategy, step: int, manifest: dict[str, Any], *, world_size: int, shard: int) -> Any:
    """The body of a parsed manifest that ``shard`` restores (the one body of a replicated step).

    Raises:
        CheckpointError: a sharded step written by another number of ranks, or without ``shard``.
    """
    bodies = manifest["shards"]
    if not manifest["sharded"]:
        return bodies[0]
    if manifest["world_size"] != world_size:
        raise CheckpointError(
            f"checkpoint step {step} in {strategy.root} was written by {manifest['world_size']} ranks as "
            f"per-rank shards, but this job has {world_size}: resume with {manifest['world_size']} "
            f"replicas (resharding is not supported), or restore into a manager made with "
            f"world_size={manifest['world_size']}"
        )
    chosen = [b for b in bodies if b["shard"] == shard]
    if not chosen:
        raise CheckpointError(
            f"checkpoint step {step} in {strategy.root} has shards "
            f"{sorted(b['shard'] for b in bodies)}, not {shard}: restore(shard=...) one of them"
        )
    return chosen[0]


def read_body(strategy: Strategy, step: int, header: dict[str, Any], entry: dict[str, Any]) -> dict[str, Any]:
    """The body of a parsed manifest ``entry``: the entry itself when inline (format version 1), else its
    body file, read (one request) and checked against the header's size and CRC32C.

    Raises:
        CheckpointCorruptError: the body file is missing, or not the one the header describes.
    """
    if "tree" in entry:
        return entry
    name = strategy.store.join(strategy.step_dir(step), entry["body"]["name"])
    try:
        data = strategy.store.read_bytes(name)
    except FileNotFoundError:
        raise CheckpointCorruptError(f"body file {name} is missing", file=name) from None
    count = header["world_size"] if header["sharded"] else 1
    return manifest_format.parse_body(data, name=name, entry=entry, count=count)


def verify(
    strategy: Strategy, step: int, header: dict[str, Any], body: dict[str, Any], *, allow_pickle: bool
) -> Loaded:
    """Read and checksum the bytes of one validated body of ``step`` (its files were checked present).

    Raises:
        CheckpointCorruptError: a leaf or data file damaged or missing.
        CheckpointError: pickled leaves without ``allow_pickle``.
    """
    name = strategy.store.join(strategy.step_dir(step), MANIFEST)
    nodes = serialization.leaf_nodes(body["tree"])
    for node in nodes:
        if node["t"] == "pickle" and not allow_pickle:
            raise CheckpointError(
                f"checkpoint step {step} holds a pickled {node.get('type')}; pass allow_pickle=True to "
                "the CheckpointManager if you trust this checkpoint"
            )
        manifest_format.check_leaf(node, name)
    buffers = datafiles.read(
        strategy.store,
        strategy.step_dir(step),
        body["prefix"],
        body["files"],
        nodes,
        threads=strategy.io_threads,
        use_mmap=strategy.mmap_reads,
    )
    return Loaded(step, header, body, nodes, buffers)


def check_files(strategy: Strategy, step: int, manifest: dict[str, Any]) -> None:
    """Every data file the manifest names is present, a plain file, of the size it says."""
    directory = strategy.step_dir(step)
    present = {e.name: e for e in strategy.store.listdir(directory)}
    for name, size in manifest_format.referenced_sizes(manifest).items():
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
    from vertexrt.checkpoint import adapters, uploads

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

    with uploads.uploads():
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
        from vertexrt.checkpoint import uploads

        if not uploads.copy_to_device(value, out):
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


def newest(
    strategy: Strategy,
    *,
    rank: int,
    world_size: int,
    shard: int | None,
    allow_pickle: bool,
    dist: Any | None,
    through_dcp: Callable[[dict[str, Any]], bool],
) -> Loaded | DcpStep | None:
    """The newest step that every rank verified (None when there is no step); every rank calls it together.

    Rank 0 (each rank by itself without ``dist``) lists the steps and offers them newest first, each with its
    manifest parsed once and its files checked (:class:`_Offers`); a rank receives only its own body. A step
    damaged on any rank is skipped on every rank; ``through_dcp(manifest)`` steps are left to DCP.

    Raises:
        CheckpointError: on every rank, when no step is usable or one rank cannot read at all.
    """
    wanted = collectives.gather(rank if shard is None else shard, dist)  # rank 0: each rank's shard
    offers = _Offers(strategy, world_size, wanted, through_dcp) if wanted is not None else None
    while True:
        offer = collectives.scatter(offers.next() if offers is not None else None, dist)
        kind = offer[0]
        if kind == "none":
            if offer[1]:
                raise CheckpointError(
                    f"no usable checkpoint in {strategy.root}: {offer[1]}. Delete the directory to start "
                    "over, or restore(step=...) a specific step"
                )
            return None
        if kind == "fatal":
            raise CheckpointError(offer[1])
        if kind == "dcp":
            return DcpStep(offer[1])
        _, step, header, entry = offer
        loaded, error, damage = None, None, ""
        try:
            body = read_body(strategy, step, header, entry)
            loaded = verify(strategy, step, header, body, allow_pickle=allow_pickle)
        except CheckpointCorruptError as exc:
            log.warning("skipping checkpoint step %d in %s and falling back: %s", step, strategy.root, exc)
            damage = str(exc)
        except CheckpointError as exc:
            error = exc
        except Exception as exc:  # e.g. EIO on a FUSE mount: stop every rank, do not leave them waiting
            error = _unreadable(step, strategy.root, exc)
        damaged, fatal = collectives.all_max([int(bool(damage)), int(error is not None)], dist)
        if fatal:
            if error is not None:
                raise error
            raise CheckpointError(
                f"restoring from {strategy.root} failed on another rank (see its log); every rank stops here"
            )
        if not damaged:
            assert loaded is not None
            return loaded
        if offers is not None:
            offers.failed(step, damage or "damaged on another rank (see its log)")


class _Offers:
    """Rank 0's side of :func:`newest`: the next candidate step, as one message per rank."""

    def __init__(
        self,
        strategy: Strategy,
        world_size: int,
        wanted: list[int],
        through_dcp: Callable[[dict[str, Any]], bool],
    ) -> None:
        self.strategy, self.world_size, self.wanted, self.through_dcp = (
            strategy,
            world_size,
            wanted,
            through_dcp,
        )
        self.steps: list[int] | None = None  # listed at the first offer (a failure is then every rank's)
        self.tried: set[int] = set()
        self.failures: list[str] = []
        self.rounds = 1

    def failed(self, step: int, why: str) -> None:
        self.failures.append(f"step {step}: {why}")

    def next(self) -> list[tuple[Any, ...]]:
        """One message per rank; a failure to list is every rank's error (no rank is left waiting)."""
        try:
            return self._next()
        except Exception as exc:
            return self._everyone(("fatal", f"listing the checkpoints in {self.strategy.root} failed: {exc}"))

    def _next(self) -> list[tuple[Any, ...]]:
        if self.steps is None:
            self.steps = self.strategy.committed_steps()[::-1]
        while True:
            while self.steps:
                step = self.steps.pop(0)
                self.tried.add(step)
                try:
                    manifest = read_manifest(self.strategy, step)
                    check_files(self.strategy, step, manifest)
                    if self.through_dcp(manifest):
                        return self._everyone(("dcp", step))
                    header = header_of(manifest)
                    bodies = [
                        body_for(self.strategy, step, manifest, world_size=self.world_size, shard=shard)
                        for shard in self.wanted
                    ]
                except CheckpointCorruptError as exc:
                    log.warning(
                        "skipping checkpoint step %d in %s and falling back: %s",
                        step,
                        self.strategy.root,
                        exc,
                    )
                    self.failed(step, str(exc))
                    continue
                except CheckpointError as exc:
                    return self._everyone(("fatal", str(exc)))
                except Exception as exc:
                    return self._everyone(("fatal", str(_unreadable(step, self.strategy.root, exc))))
                return [("load", step, header, body) for body in bodies]
            if not self.failures or self.rounds >= _RESTORE_ROUNDS:
                return self._everyone(("none", "; ".join(self.failures)))
            self.rounds += 1  # a writer may have changed the directory meanwhile: look again
            self.steps = [s for s in self.strategy.committed_steps()[::-1] if s not in self.tried]
            if not self.steps:
                return self._everyone(("none", "; ".join(self.failures)))

    def _everyone(self, message: tuple[Any, ...]) -> list[tuple[Any, ...]]:
        return [message] * len(self.wanted)


def _unreadable(step: int, root: str, exc: Exception) -> CheckpointError:
    """A typed error for an untyped failure reading ``step`` (all ranks then stop together)."""
    error = CheckpointError(
        f"reading checkpoint step {step} in {root} failed: {type(exc).__name__}: {exc}. "
        "Check the checkpoint storage (mount, permissions, network), then restart the job"
    )
    error.__cause__ = exc
    return error

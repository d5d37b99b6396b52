"""The Trainer's checkpoint layout when a module holds DTensors (FSDP2 ``fully_shard``, tensor parallel).

Every rank saves through torch.distributed.checkpoint (``vertexrt.checkpoint.dcp``): modules and their
optimizers by ``get_state_dict`` (each rank its local shards with their global placement), the loop position
and other replicated state under ``"_shared"``, and what each rank has its own of (RNG, data read position,
per-rank attributes) under ``"_rank<r>"``. A restore onto another world size reshards the modules and
optimizers and restores the loop position; per-rank state cannot be carried to a different set of ranks, so
it starts fresh there, with a warning naming it.

Example:
    >>> layout = ShardedLayout(trainer.state(), trainer._loop, rank=0, world_size=2)  # doctest: +SKIP
    >>> manager.save(step, layout.tree)          # every rank  # doctest: +SKIP
    >>> layout.restore(manager, step)            # False: per-rank state was not carried  # doctest: +SKIP
"""

from __future__ import annotations

import base64
import binascii
import json
import math
from typing import Any

from vertexrt.errors import CheckpointCorruptError, CheckpointError


class Packed:
    """A dict of live state (``Stateful`` objects, tensors, plain values) as one opaque DCP value.

    DCP flattens nested dicts into keys that must match between save and restore, and unpickles values
    with ``weights_only`` (no numpy, no bytes); packing keeps the state free-form: vertexrt's own encoding
    as a JSON tree plus one base64 string of the leaves' bytes.
    """

    def __init__(self, state: dict[str, Any], what: str, *, allow_pickle: bool = False) -> None:
        self.state, self.what, self.allow_pickle = state, what, allow_pickle

    def state_dict(self) -> dict[str, Any]:
        from vertexrt.checkpoint import serialization

        tree, leaves = serialization.encode(self.state, allow_pickle=self.allow_pickle)
        parts, offset = [], 0
        for node, enc in leaves:  # each leaf node (part of the tree) records where its bytes are
            data = enc.data if enc.data is not None else enc.device.cpu().numpy()
            node["span"] = [offset, len(data)]
            offset += len(data)
            parts.append(data.tobytes())
        return {"tree": json.dumps(tree), "blob": base64.b64encode(b"".join(parts)).decode("ascii")}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        import numpy as np

        from vertexrt.checkpoint import adapters, serialization

        try:
            tree, blob = json.loads(state["tree"]), base64.b64decode(state["blob"], validate=True)
            buffer = np.frombuffer(blob, dtype=np.uint8)

            def value(node: dict[str, Any]) -> Any:
                start, length = node["span"]
                if not (
                    isinstance(start, int) and isinstance(length, int) and 0 <= start <= len(blob) - length
                ):
                    raise ValueError(f"span {node['span']!r} outside {len(blob)} bytes")
                if length == 0 and math.prod(node.get("shape", [])) != 0:  # no allocation from a bare shape
                    raise ValueError(f"shape {str(node['shape'])[:80]} in 0 bytes")
                return adapters.value(node["t"], node, buffer[start : start + length].copy())

            self.state.update(serialization.decode(tree, value, self.state))  # live objects: loaded in place
        except CheckpointError:
            raise
        except (KeyError, TypeError, ValueError, IndexError, RuntimeError, binascii.Error) as exc:
            raise CheckpointCorruptError(f"the checkpoint's {self.what} is malformed: {exc}") from None


class ShardedLayout:
    """The DCP tree of a Trainer's state (see the module docstring)."""

    def __init__(
        self, full: dict[str, Any], loop: Any, *, rank: int, world_size: int, allow_pickle: bool = False
    ) -> None:
        import torch

        replicated, local = full["replicated"], full["local"]
        live = (torch.nn.Module, torch.optim.Optimizer)
        self.rank, self.world_size = rank, world_size
        self.key = f"_rank{rank}"
        self.saved_world: int | None = None  # of the step restored last
        self.local_names = sorted(name for name in local if not name.startswith("_"))
        others = {name: value for name, value in replicated.items() if not isinstance(value, live)}
        self.tree: dict[str, Any] = {name: v for name, v in replicated.items() if isinstance(v, live)}
        self.tree["_shared"] = Packed(
            {"_loop": loop, **others}, "replicated state (_shared)", allow_pickle=allow_pickle
        )
        self.tree[self.key] = Packed(
            dict(local), f"state of rank {rank} ({self.key})", allow_pickle=allow_pickle
        )

    def restore(self, manager: Any, step: int) -> bool:
        """Load ``step``; True when this rank's own state came back too (saved by as many ranks).

        Every rank takes the same path: rank 0 alone reads the manifest, and a read that fails there raises
        the same error on every rank (CheckpointCorruptError when the step is damaged) before any enters
        DCP's collectives.
        """
        from vertexrt.checkpoint import dcp
        from vertexrt.distributed import collectives

        dist, saved, error = collectives.torch_dist(), None, None
        if manager.rank == 0:  # the others are told (per-rank reads of a manifest that grows with the ranks)
            try:
                saved = manager.metadata(step).get("world_size")
            except Exception as exc:
                error = exc
        dcp.agree(error, dist, f"reading the manifest of step {step}")
        self.saved_world = collectives.broadcast(saved, dist)  # rank 0's: one answer for every rank
        carried = self.saved_world == self.world_size
        target = self.tree if carried else {k: v for k, v in self.tree.items() if k != self.key}
        manager.restore(target, step=step)
        return carried

    def not_carried(self, loop: Any, attributes: list[str]) -> str:
        """What the last restore, from a different world size, could not carry (for a warning)."""
        names = ", ".join([*self.local_names, *attributes]) or "none"
        return (
            f"checkpoint step {loop.step} was saved by {self.saved_world} ranks and this job has "
            f"{self.world_size}: the sharded modules and optimizers and the loop position (step "
            f"{loop.step}, epoch {loop.epoch}) are restored, but each rank's own state is not carried "
            "over and starts fresh: the random generators, the train_data read position (the epoch in "
            f"progress replays its order and skips the {loop.batch_in_epoch} batches already trained) and "
            f"the per-rank attributes ({names})"
        )

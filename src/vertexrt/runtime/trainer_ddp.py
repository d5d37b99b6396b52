"""The Trainer's DistributedDataParallel wrapping: which module attributes to wrap, and putting them back.

With several replicas each module attribute with trainable parameters that does not already synchronise its
gradients (DDP, FSDP) and holds no DTensors is wrapped in DDP for the duration of ``fit()``. A module holding
DTensors (FSDP2, tensor parallel) synchronises itself, but only if it holds no plain trainable parameter.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
from collections.abc import Container, Iterator
from typing import Any

from vertexrt.errors import ConfigError

logger = logging.getLogger(__name__)


class DdpWrapping:
    """The module attributes of ``owner`` wrapped in DDP, and the user's modules inside those wrappers."""

    def __init__(self, owner: object) -> None:
        self.owner = owner
        self.wrapped: dict[str, Any] = {}  # attribute -> the user's module inside the wrapper

    def wrap(self, *, skip: Container[str], world_size: int) -> None:
        """Wrap each trainable module attribute (not in ``skip``) that does not synchronise gradients."""
        import torch

        from vertexrt.checkpoint.dcp import holds_dtensors

        modules = {
            name: value
            for name, value in vars(self.owner).items()
            if not name.startswith("_")
            and name not in skip
            and isinstance(value, torch.nn.Module)
            and not _synchronises_gradients(value)
            and any(p.requires_grad for p in value.parameters())
        }
        for name, module in list(modules.items()):
            if holds_dtensors(module):  # sharded (FSDP2 / tensor parallel): DTensors synchronise themselves
                _check_no_plain_parameters(name, module)
                del modules[name]
        inner = {id(sub) for m in modules.values() for sub in itertools.islice(m.modules(), 1, None)}
        for name, module in modules.items():
            if id(module) in inner:  # a part of another module that is wrapped
                continue
            device = next(module.parameters()).device
            ids = [device.index] if device.type == "cuda" else None
            setattr(self.owner, name, torch.nn.parallel.DistributedDataParallel(module, device_ids=ids))
            self.wrapped[name] = module
        if self.wrapped:
            logger.info(
                "wrapped %s in DistributedDataParallel for %d replicas (Trainer(ddp=False) leaves modules as "
                "they are)",
                ", ".join(f"self.{name}" for name in self.wrapped),
                world_size,
            )

    def unwrap_all(self) -> None:
        """Put back the modules wrapped in DDP (a later ``wrap()`` wraps them again)."""
        wrapped, self.wrapped = self.wrapped, {}
        for name, module in wrapped.items():
            setattr(self.owner, name, module)

    @contextlib.contextmanager
    def bare(self) -> Iterator[None]:
        """The wrapped modules, bare, for the duration of the block."""
        wrappers = {name: getattr(self.owner, name) for name in self.wrapped}
        for name, module in self.wrapped.items():
            setattr(self.owner, name, module)
        try:
            yield
        finally:
            for name, wrapper in wrappers.items():
                setattr(self.owner, name, wrapper)


def _check_no_plain_parameters(name: str, module: Any) -> None:
    """A module holding DTensors must hold nothing else trainable: no DDP can wrap it, and nothing would
    average a plain parameter's gradients, so the replicas' copies would silently drift apart.

    Under tensor parallelism alone a plain parameter is a bug too: a replicated one is a DTensor with a
    ``Replicate()`` placement, whose gradient DTensor reduces where the placements call for it and which DCP
    saves as one replicated value; a plain tensor gets neither (each rank's copy is its own).
    """
    from torch.distributed.tensor import DTensor

    plain = [p for p, v in module.named_parameters() if v.requires_grad and not isinstance(v, DTensor)]
    if not plain:
        return
    shown = ", ".join(f"self.{name}.{p}" for p in plain[:8]) + (
        f" and {len(plain) - 8} more" if len(plain) > 8 else ""
    )
    fsdp = any(_synchronises_gradients(sub) for sub in module.modules())
    fix = (
        f"also call fully_shard(self.{name}) on the root module after fully_shard on its layers"
        if fsdp
        else "make them Replicate() DTensors too: distribute_module(<submodule>, mesh, input_fn=...) with an "
        "input_fn that turns its inputs into DTensors, or parallelize_module(..., {'<submodule>': "
        "SequenceParallel()}) for a norm over sequence-sharded activations"
    )
    kind = "FSDP2" if fsdp else "tensor parallel"
    raise ConfigError(
        f"self.{name} holds DTensor parameters ({kind}) and plain trainable "
        f"parameters ({shown}) whose gradients nothing averages across the ranks, so they would "
        f"diverge: {fix} (or Trainer(ddp=False) if the step synchronises them itself)"
    )


def _synchronises_gradients(module: Any) -> bool:
    """True for DistributedDataParallel and FSDP (1 and 2) modules: they average gradients themselves."""
    names = {"DistributedDataParallel", "FullyShardedDataParallel", "FSDPModule"}
    return any(cls.__name__ in names for cls in type(module).__mro__)


def unwrap(value: Any) -> Any:
    """The module inside a DistributedDataParallel wrapper (its state_dict keys lack ``module.``)."""
    if type(value).__name__ == "DistributedDataParallel":
        return value.module
    return value

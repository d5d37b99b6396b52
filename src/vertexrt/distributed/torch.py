"""PyTorch bootstrapping: ``torch.distributed`` from the cluster, and one process per GPU on a node.

Vertex starts one process per replica (VM) and sets node-level ``RANK``/``WORLD_SIZE``. :func:`init_torch`
turns the cluster into a process group (global rank = node rank x processes per node + local rank);
:func:`spawn` starts one process per GPU so no wrapper script is needed. ``torchrun`` works too, with
``init_torch()`` inside ``train.py`` (the defaults cover single-replica jobs, which get no ``MASTER_*``)::

    torchrun --nnodes=${WORLD_SIZE:-1} --node-rank=${RANK:-0} --nproc-per-node=gpu
             --master-addr=${MASTER_ADDR:-127.0.0.1} --master-port=${MASTER_PORT:-29500} train.py

Example:
    >>> from vertexrt.distributed import init_torch
    >>> handle = init_torch()                 # gloo on CPU, nccl when this rank has a GPU
    >>> model = torch.nn.parallel.DistributedDataParallel(model.to(handle.device))
    >>> handle.shutdown()
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from vertexrt import devices
from vertexrt.distributed.detection import cluster as current_cluster
from vertexrt.distributed.model import Cluster
from vertexrt.errors import ConfigError

logger = logging.getLogger(__name__)

DEFAULT_TIMEOUT = timedelta(minutes=30)


@dataclass(frozen=True)
class TorchHandle:
    """The initialised process group as this process sees it."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    backend: str
    device: Any  # torch.device

    def shutdown(self) -> None:
        """Destroy the default process group (safe to call twice)."""
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


def init_torch(
    backend: str = "auto",
    timeout: timedelta | float = DEFAULT_TIMEOUT,
    *,
    cluster: Cluster | None = None,
) -> TorchHandle:
    """Initialise ``torch.distributed`` from the cluster; idempotent.

    Args:
        backend: ``auto`` (``nccl`` when this rank has a GPU, else ``gloo``), or any torch backend name.
        timeout: rendezvous and collective timeout (a ``timedelta`` or seconds). Vertex starts replicas in
            parallel, so peers may take minutes to arrive.
        cluster: the cluster to use (default :func:`vertexrt.distributed.cluster`).

    Raises:
        ConfigError: this replica is not part of the training world (ps, evaluator, Reduction Server), or
            the cluster has no rendezvous address.
    """
    import torch
    import torch.distributed as dist

    c = current_cluster() if cluster is None else cluster
    if not c.in_training_world:
        raise ConfigError(
            f"init_torch(): this replica is {c.role} {c.task_index} (from {c.source}), which is not part of "
            "the training world; only chief and worker replicas join the process group"
        )
    device = torch.device(devices.select_device(c.local_rank, c.local_world_size, torch.cuda.device_count()))
    if dist.is_initialized():
        return _handle(dist, c, device)
    chosen = ("nccl" if device.type == "cuda" else "gloo") if backend == "auto" else backend
    if chosen == "nccl":
        devices.apply_nccl_defaults()
    if device.type == "cuda":
        torch.cuda.set_device(device)
    wait = timeout if isinstance(timeout, timedelta) else timedelta(seconds=timeout)
    if c.world_size == 1:
        dist.init_process_group(chosen, store=dist.HashStore(), rank=0, world_size=1, timeout=wait)
    elif c.source == "torchrun":
        dist.init_process_group(chosen, init_method="env://", timeout=wait)  # may use torchrun's agent store
    else:
        host, port = _rendezvous(c)
        logger.info("rendezvous at %s:%d as rank %d of %d (%s)", host, port, c.rank, c.world_size, chosen)
        dist.init_process_group(
            chosen, init_method=f"tcp://{host}:{port}", rank=c.rank, world_size=c.world_size, timeout=wait
        )
    return _handle(dist, c, device)


def _handle(dist: Any, c: Cluster, device: Any) -> TorchHandle:
    return TorchHandle(
        rank=dist.get_rank(),
        world_size=dist.get_world_size(),
        local_rank=c.local_rank,
        local_world_size=c.local_world_size,
        backend=str(dist.get_backend()),
        device=device,
    )


def _rendezvous(c: Cluster) -> tuple[str, int]:
    if c.rendezvous_address is None:
        raise ConfigError(
            f"init_torch(): {c.world_size} processes but the cluster (from {c.source}) names no rendezvous "
            "address; set MASTER_ADDR and MASTER_PORT"
        )
    host, _, port = c.rendezvous_address.rpartition(":")
    # The store's server listens on every interface; rank 0 reaches it over loopback because its own
    # service name may not resolve from inside its pod early in the job (see vertex-contract §1.6).
    return ("127.0.0.1" if c.rank == 0 else host.strip("[]")), int(port)


def spawn(fn: Callable[..., Any], args: tuple[Any, ...] = (), nprocs: int | str = "gpu") -> None:
    """Run ``fn(local_rank, *args)`` in ``nprocs`` processes on this node, each a member of the job's world.

    ``nprocs="gpu"`` starts one process per visible GPU (one process when there is none). Each child sees
    the variables torchrun would set (``LOCAL_RANK``, ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``...), so
    :func:`init_torch` and :func:`~vertexrt.distributed.cluster` work inside ``fn``. Every node of the job
    must call ``spawn`` with the same ``nprocs``. ``fn`` must be importable (a module-level function).
    A child's exception fails the whole call (``torch.multiprocessing.ProcessRaisedException``).

    Example:
        >>> def train(local_rank):
        ...     handle = init_torch()
        >>> if __name__ == "__main__":
        ...     spawn(train, nprocs="gpu")
    """
    import torch.multiprocessing as mp

    c = current_cluster()
    if c.source == "torchrun":
        raise ConfigError(
            "spawn() inside a torchrun launch: this process already is one of several per node; call the "
            "function directly"
        )
    if not c.in_training_world:
        raise ConfigError(f"spawn(): this replica is {c.role} {c.task_index}, not part of the training world")
    count = _process_count(nprocs)
    if count == 1:
        fn(0, *args)
        return
    address = c.rendezvous_address if c.num_nodes > 1 else f"127.0.0.1:{free_port()}"
    if address is None:
        raise ConfigError(
            f"spawn(): {c.num_nodes} nodes but no rendezvous address (set MASTER_ADDR/MASTER_PORT)"
        )
    envs = [child_environment(c, local_rank, count, address) for local_rank in range(count)]
    mp.start_processes(_child, args=(fn, envs, args), nprocs=count, join=True, start_method="spawn")


def child_environment(c: Cluster, local_rank: int, nprocs: int, rendezvous: str) -> dict[str, str]:
    """The torchrun-style variables for process ``local_rank`` of ``nprocs`` on node ``c.node_rank``,
    meeting at ``rendezvous`` (``host:port``)."""
    host, _, port = rendezvous.rpartition(":")
    return {
        "LOCAL_RANK": str(local_rank),
        "LOCAL_WORLD_SIZE": str(nprocs),
        "RANK": str(c.node_rank * nprocs + local_rank),
        "WORLD_SIZE": str(c.num_nodes * nprocs),
        "GROUP_RANK": str(c.node_rank),
        "GROUP_WORLD_SIZE": str(c.num_nodes),
        "MASTER_ADDR": host,
        "MASTER_PORT": port,
    }


def _process_count(nprocs: int | str) -> int:
    if nprocs == "gpu":
        return max(devices.gpu_count(), 1)
    if isinstance(nprocs, bool) or not isinstance(nprocs, int) or nprocs < 1:
        raise ConfigError(f"spawn(nprocs={nprocs!r}): expected a positive integer or 'gpu'")
    return nprocs


def _child(
    local_rank: int, fn: Callable[..., Any], envs: list[Mapping[str, str]], args: tuple[Any, ...]
) -> None:
    os.environ.update(envs[local_rank])
    fn(local_rank, *args)


def free_port() -> int:
    """A TCP port that is free on loopback right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])

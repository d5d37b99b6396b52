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

import atexit
import logging
import os
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from vertexrt import gpus
from vertexrt._net import free_port
from vertexrt.distributed import rendezvous
from vertexrt.distributed.cluster_model import Cluster
from vertexrt.distributed.detection import cluster as current_cluster
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
        timeout: collective timeout (a ``timedelta`` or seconds). The rendezvous has its own deadline,
            ``VERTEXRT_RENDEZVOUS_TIMEOUT`` seconds (default 30 min): Vertex starts replicas in parallel,
            but their VMs come up minutes apart; until then workers wait for the chief's address, logging
            "waiting for the chief at host:port, 45 s", and every process logs "k of N replicas joined".
        cluster: the cluster to use (default :func:`vertexrt.distributed.cluster`).

    Raises:
        ConfigError: this replica is not part of the training world (ps, evaluator, Reduction Server), or
            the cluster has no rendezvous address, or ``backend="nccl"`` without a GPU.
        RendezvousTimeout: the chief did not answer, or not every process joined, by the deadline.
    """
    import torch
    import torch.distributed as dist

    c = current_cluster() if cluster is None else cluster
    if not c.in_training_world:
        raise ConfigError(
            f"init_torch(): this replica is {c.role} {c.task_index} (from {c.source}), which is not part of "
            "the training world; only chief and worker replicas join the process group"
        )
    chosen, device, extra = process_group_arguments(c, backend, torch.cuda.device_count())
    destroy_at_exit()
    if dist.is_initialized():
        return _handle(dist, c, device)
    if chosen == "nccl":
        gpus.apply_nccl_defaults()
    if device.type == "cuda":
        torch.cuda.set_device(device)  # this process's own GPU, picked by its local rank
    wait = timeout if isinstance(timeout, timedelta) else timedelta(seconds=timeout)
    if c.world_size == 1:
        store = dist.HashStore()
        dist.init_process_group(chosen, store=store, rank=0, world_size=1, timeout=wait, **extra)
    elif c.source == "torchrun" and os.environ.get("TORCHELASTIC_RUN_ID"):
        # torchrun's agent already held the rendezvous; env:// may use its store
        dist.init_process_group(chosen, init_method="env://", timeout=wait, **extra)
    else:
        store = _join(dist, c, wait)
        logger.info("process group %s: rank %d of %d on %s", chosen, c.rank, c.world_size, device)
        dist.init_process_group(
            chosen, store=store, rank=c.rank, world_size=c.world_size, timeout=wait, **extra
        )
    return _handle(dist, c, device)


#: Whether the exit hook is registered, and whether this process failed (then the hook does nothing).
_exit_state = {"registered": False, "failed": False}


def destroy_at_exit() -> None:
    """Destroy the default process group when this process exits, unless it failed (registered once).

    torch 2.13 aborts the interpreter's teardown of a live gloo group in about one run in seven (SIGABRT,
    exit 134: a finished job reported as failed); measured 3 of 20 two-process runs without a destroy, 0 of
    30 with one. After an uncaught exception, or :func:`mark_failed`, the group is left to the OS: destroying
    it would wait for collectives that peers may never finish. :func:`init_torch` and the Lightning
    environment call this; frameworks that create the group themselves (Fabric) need nothing else.
    """
    if _exit_state["registered"]:
        return
    _exit_state["registered"] = True
    previous = sys.excepthook

    def note_uncaught(*exc_info: Any) -> None:
        mark_failed()
        previous(*exc_info)

    sys.excepthook = note_uncaught
    atexit.register(_destroy_unless_failed)


def mark_failed() -> None:
    """This process failed: :func:`destroy_at_exit` leaves its process group alone."""
    _exit_state["failed"] = True


def _destroy_unless_failed() -> None:
    dist = sys.modules.get("torch.distributed")
    if _exit_state["failed"] or dist is None or not dist.is_available() or not dist.is_initialized():
        return
    try:
        dist.destroy_process_group()
    except Exception as exc:  # noqa: BLE001 - the process is exiting; a failed teardown changes nothing
        logger.debug("destroying the process group at exit: %s", exc)


def process_group_arguments(c: Cluster, backend: str, num_gpus: int) -> tuple[str, Any, dict[str, Any]]:
    """What :func:`init_torch` passes for this process: the backend, its ``torch.device`` (``cuda:<local
    rank>`` among the visible GPUs, see :func:`vertexrt.gpus.select_device`) and the extra
    ``init_process_group`` arguments: ``device_id`` for NCCL, which binds the communicator to this
    process's GPU (without it NCCL guesses the device from the global rank, and may hang).

    Example:
        >>> process_group_arguments(Cluster("torchrun", local_rank=1, local_world_size=2), "auto", 2)
        ('nccl', device(type='cuda', index=1), {'device_id': device(type='cuda', index=1)})
    """
    import torch

    device = torch.device(gpus.select_device(c.local_rank, c.local_world_size, num_gpus))
    gpus.warn_unused_gpus(c.local_world_size, num_gpus)
    chosen = ("nccl" if device.type == "cuda" else "gloo") if backend == "auto" else backend
    extra: dict[str, Any] = {}
    if chosen == "nccl":
        if device.type != "cuda":
            raise ConfigError(
                f"init_torch(backend='nccl'): rank {c.rank} sees no GPU (CUDA_VISIBLE_DEVICES="
                f"{os.environ.get('CUDA_VISIBLE_DEVICES', '<unset>')}); use backend='auto' or 'gloo' on CPU"
            )
        extra["device_id"] = device
    return chosen, device, extra


#: The store key every process increments once it has joined.
_JOINED = "vertexrt/joined"


def _join(dist: Any, c: Cluster, wait: timedelta) -> Any:
    """The job's TCPStore, once every process has joined: rank 0 serves it, the others first wait for its
    address (patient rendezvous, see :mod:`vertexrt.distributed.rendezvous`)."""
    deadline = rendezvous.Deadline.from_environment()
    host, port = _rendezvous(c)
    if c.rank != 0:
        rendezvous.wait_for_address(host, port, deadline)
    logger.info("rendezvous at %s:%d as rank %d of %d", host, port, c.rank, c.world_size)
    store = dist.TCPStore(
        host, port, c.world_size, is_master=c.rank == 0, timeout=wait, wait_for_workers=False
    )
    store.add(_JOINED, 1)
    noun = "replicas" if c.local_world_size == 1 else "processes"
    rendezvous.wait_for_count(lambda: int(store.add(_JOINED, 0)), c.world_size, deadline, noun)
    return store


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
    # The store's server listens on every interface; the chief's replica reaches it over loopback because
    # its own service name may not resolve from inside its pod early in the job (see vertex-contract §1.6).
    return ("127.0.0.1" if c.node_rank == 0 else host.strip("[]")), int(port)


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
        return max(gpus.gpu_count(), 1)
    if isinstance(nprocs, bool) or not isinstance(nprocs, int) or nprocs < 1:
        raise ConfigError(f"spawn(nprocs={nprocs!r}): expected a positive integer or 'gpu'")
    return nprocs


def _child(
    local_rank: int, fn: Callable[..., Any], envs: list[Mapping[str, str]], args: tuple[Any, ...]
) -> None:
    os.environ.update(envs[local_rank])
    fn(local_rank, *args)

"""The GPUs of this node and which one a local rank takes: pure choice, inventory, NCCL defaults.

Below :mod:`vertexrt.distributed` (whose framework bootstraps use it) and world-free: every function takes
the counts it needs. :mod:`vertexrt.devices` is the public face that fills them from the world
(:func:`vertexrt.distributed.world_info`). The calls into CUDA, torch, TensorFlow and ``nvidia-smi`` are
thin and import a framework only when the program has already imported it.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
from collections.abc import Mapping, MutableMapping, Sequence
from dataclasses import dataclass

from vertexrt.errors import ConfigError

# the public face's name (vertexrt.devices): what users filter these warnings by, as before the split
logger = logging.getLogger("vertexrt.devices")
_warned_unused: set[tuple[int, int]] = set()

#: NCCL settings applied (only where unset) before an NCCL process group starts.
NCCL_DEFAULTS: dict[str, str] = {
    # On a collective error or timeout, abort the communicator and fail the process instead of hanging
    # forever, so Vertex restarts the replica. torchrun's agent sets the same default.
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
    # Print NCCL's own warnings (why a connection or a collective failed) into the job's logs.
    "NCCL_DEBUG": "WARN",
}


@dataclass(frozen=True)
class GPU:
    """One GPU as the inventory reports it; ``index`` counts visible devices from 0 (as CUDA does)."""

    index: int
    name: str
    memory_bytes: int | None = None
    uuid: str | None = None


def select_device(local_rank: int, local_world_size: int, num_gpus: int) -> str:
    """The device string for one process: ``"cpu"``, or ``"cuda:<local_rank>"`` among the visible GPUs.

    One process per node uses ``cuda:0`` and may drive all visible GPUs (e.g. TF ``MirroredStrategy``). A
    process whose ``CUDA_VISIBLE_DEVICES`` names exactly one GPU (a wrapper gave each process its own) uses
    ``cuda:0`` too, whatever its local rank.

    Raises:
        ConfigError: more processes on the node than visible GPUs.
    """
    if not 0 <= local_rank < local_world_size:
        raise ConfigError(f"local_rank={local_rank} is out of range for local_world_size={local_world_size}")
    if num_gpus <= 0:
        return "cpu"
    if local_world_size == 1 or (num_gpus == 1 and _one_gpu_of_its_own(local_world_size)):
        return "cuda:0"
    if local_world_size > num_gpus:
        raise ConfigError(
            f"{local_world_size} processes on this node (LOCAL_WORLD_SIZE) but only {num_gpus} visible "
            f"GPU(s) (CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', '<unset>')}); start one "
            "process per GPU, e.g. vertexrt.distributed.spawn(fn, nprocs='gpu')"
        )
    return f"cuda:{local_rank}"


def _one_gpu_of_its_own(local_world_size: int) -> bool:
    """This process sees one GPU through ``CUDA_VISIBLE_DEVICES`` and the node has a GPU for each of its
    processes (nvidia-smi lists every physical GPU; without it, the wrapper is trusted)."""
    tokens = visible_devices(os.environ.get("CUDA_VISIBLE_DEVICES"))
    if tokens is None or len(tokens) != 1:
        return False
    physical = _nvidia_smi_inventory()
    return not physical or len(physical) >= local_world_size


def visible_devices(value: str | None) -> list[str] | None:
    """Parse ``CUDA_VISIBLE_DEVICES``: ``None`` when unset (all GPUs), else the listed tokens in order.

    As CUDA does, an empty value or ``-1`` hides every GPU, and parsing stops at the first invalid token.
    """
    if value is None:
        return None
    tokens: list[str] = []
    for raw in value.split(","):
        token = raw.strip()
        if not (token.isdigit() or token.startswith(("GPU-", "MIG-"))):
            break
        tokens.append(token)
    return tokens


def filter_visible(gpus: Sequence[GPU], cuda_visible_devices: str | None) -> list[GPU]:
    """The GPUs a CUDA program sees, renumbered from 0, from a physical inventory (e.g. ``nvidia-smi``)."""
    tokens = visible_devices(cuda_visible_devices)
    if tokens is None:
        return list(gpus)
    chosen: list[GPU] = []
    for token in tokens:
        if token.isdigit():
            match = next((g for g in gpus if g.index == int(token)), None)
        else:
            match = next((g for g in gpus if g.uuid and g.uuid.startswith(token)), None)
        if match is None or match in chosen:
            break  # CUDA stops at the first device it cannot use
        chosen.append(match)
    return [GPU(i, g.name, g.memory_bytes, g.uuid) for i, g in enumerate(chosen)]


def parse_nvidia_smi(text: str) -> list[GPU]:
    """Parse ``nvidia-smi --query-gpu=index,uuid,name,memory.total --format=csv,noheader,nounits``."""
    gpus = []
    for line in text.splitlines():
        fields = [f.strip() for f in line.split(",")]
        if len(fields) < 4 or not fields[0].isdigit():
            continue
        memory = int(float(fields[3]) * 2**20) if fields[3].replace(".", "", 1).isdigit() else None
        gpus.append(GPU(int(fields[0]), fields[2], memory, fields[1] or None))
    return gpus


def gpu_inventory(environ: Mapping[str, str] | None = None) -> list[GPU]:
    """The visible GPUs (count, names, memory), from torch or TensorFlow if already imported, else
    ``nvidia-smi``; ``[]`` when there is none. Never imports a framework."""
    env = os.environ if environ is None else environ
    if "torch" in sys.modules:
        return _torch_inventory()
    if "tensorflow" in sys.modules:
        return _tf_inventory()
    return filter_visible(_nvidia_smi_inventory(), env.get("CUDA_VISIBLE_DEVICES"))


def gpu_count() -> int:
    """Number of visible GPUs (see :func:`gpu_inventory`)."""
    if "torch" in sys.modules:
        import torch

        return int(torch.cuda.device_count())
    return len(gpu_inventory())


def _torch_inventory() -> list[GPU]:
    import torch

    gpus = []
    for i in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(i)
        gpus.append(GPU(i, props.name, int(props.total_memory), str(getattr(props, "uuid", "")) or None))
    return gpus


def _tf_inventory() -> list[GPU]:
    import tensorflow as tf

    gpus = []
    for i, device in enumerate(tf.config.list_physical_devices("GPU")):
        details = tf.config.experimental.get_device_details(device)
        gpus.append(GPU(i, str(details.get("device_name", device.name))))
    return gpus


def _nvidia_smi_inventory() -> list[GPU]:
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return []
    query = [exe, "--query-gpu=index,uuid,name,memory.total", "--format=csv,noheader,nounits"]
    try:
        out = subprocess.run(query, capture_output=True, text=True, timeout=20, check=True).stdout
    except (OSError, subprocess.SubprocessError) as err:
        logger.warning("nvidia-smi failed (%s); assuming no GPU", err)
        return []
    return parse_nvidia_smi(out)


def warn_unused_gpus(local_world_size: int, num_gpus: int) -> bool:
    """Warn (once per process and shape) when this node has more visible GPUs than training processes, so
    some GPUs sit idle; returns whether that is the case. (One TF ``MirroredStrategy`` process drives every
    GPU: do not call it there.)

    Example:
        >>> warn_unused_gpus(local_world_size=1, num_gpus=8)  # doctest: +SKIP
        True
    """
    processes, gpus = local_world_size, num_gpus
    if processes >= gpus:
        return False
    if (processes, gpus) not in _warned_unused:
        _warned_unused.add((processes, gpus))
        logger.warning(
            "%d GPUs are visible (CUDA_VISIBLE_DEVICES=%s) but this node runs %d training process(es), each "
            "using one GPU: %d GPU(s) stay idle. Start one process per GPU: `vertexrt local-run "
            "--processes-per-node %d`, vertexrt.distributed.spawn(fn, nprocs='gpu'), or `torchrun "
            "--nproc-per-node=gpu`.",
            gpus,
            os.environ.get("CUDA_VISIBLE_DEVICES", "<unset>"),
            processes,
            gpus - processes,
            gpus,
        )
    return True


def apply_nccl_defaults(environ: MutableMapping[str, str] | None = None) -> dict[str, str]:
    """Set each of :data:`NCCL_DEFAULTS` that is unset; returns what was set."""
    env: MutableMapping[str, str] = os.environ if environ is None else environ
    applied = {k: v for k, v in NCCL_DEFAULTS.items() if k not in env}
    env.update(applied)
    return applied

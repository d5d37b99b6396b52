"""The cluster model: what every cluster source (CLUSTER_SPEC, TF_CONFIG, torchrun, ...) is read into.

Example:
    >>> c = Cluster(source="local")
    >>> c.rank, c.world_size, c.is_chief, c.replica
    (0, 1, True, 'chief-0')
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

#: The roles whose replicas form the training world (the others: ``ps``, ``reduction_server``, ``evaluator``).
TRAINING_ROLES = ("chief", "worker")


@dataclass(frozen=True)
class Pool:
    """One pool of replicas as the source names it (``workerpool1``, ``worker``, ...) and its role."""

    name: str
    role: str
    addresses: tuple[str, ...]


@dataclass(frozen=True)
class Cluster:
    """This process's place in the job, whatever variable described it.

    Ranks count *processes*: ``rank = node_rank * local_world_size + local_rank`` on a uniform cluster, and
    ``world_size`` = training nodes x processes per node. Replicas outside the training world (parameter
    servers, Reduction Server, evaluators) get ``rank = node_rank = -1`` (as ``torch.distributed`` reports a
    non-member) and ``world_size`` of the training world they serve.

    Two words mean one thing each, everywhere in vertexrt:

    - **replica**: one VM of the job as Vertex names it, ``<pool>-<index>`` (``workerpool0-0``,
      ``workerpool1-3``; ``chief-0``/``worker-2`` when the source lists no pools); see :attr:`replica`. A
      replica runs one process, or several with torchrun (they share the replica name, not the rank).
    - **chief**: the one *process* that writes, global rank 0 of the training world (:attr:`is_chief`);
      not "every process on the chief replica".

    Attributes:
        source: where it came from: ``"torchrun"``, ``"CLUSTER_SPEC"``, ``"TF_CONFIG"``, ``"MASTER_ADDR"``
            or ``"local"``.
        role: ``chief``, ``worker``, ``ps``, ``reduction_server`` or ``evaluator``.
        task_index: index of this replica within its pool.
        pools: every pool the source lists (empty when it lists none, e.g. ``MASTER_ADDR``).
        chief_address: ``host:port`` of the chief replica (worker 0 when there is no chief pool).
        rendezvous_address: ``host:port`` for ``torch.distributed``: ``MASTER_ADDR:MASTER_PORT`` when set,
            else ``chief_address``.
        trial_id: the hyperparameter-tuning trial (``CLOUD_ML_TRIAL_ID`` or ``task.trial``), else ``None``.
    """

    source: str
    role: str = "chief"
    task_index: int = 0
    pools: tuple[Pool, ...] = ()
    node_rank: int = 0
    num_nodes: int = 1
    local_rank: int = 0
    local_world_size: int = 1
    rank: int = 0
    world_size: int = 1
    chief_address: str | None = None
    rendezvous_address: str | None = None
    trial_id: str | None = None

    @property
    def is_chief(self) -> bool:
        """True on the one process of the job that writes (training rank 0)."""
        return self.rank == 0

    @property
    def replica(self) -> str:
        """The Vertex replica name, e.g. ``workerpool1-0`` (``worker-0`` when the source lists no pools)."""
        own = self.pool(self.role)
        return f"{own.name if own else self.role}-{self.task_index}"

    @property
    def in_training_world(self) -> bool:
        """False on parameter servers, Reduction Server replicas and evaluators."""
        return self.rank >= 0

    @property
    def is_distributed(self) -> bool:
        """More than one training process in the job."""
        return self.world_size > 1

    def pool(self, role: str) -> Pool | None:
        """The pool with this role, if the source lists one."""
        return next((p for p in self.pools if p.role == role), None)

    def summary(self) -> dict[str, Any]:
        """A flat dict for ``vertexrt info`` and logs."""
        return {
            "source": self.source,
            "role": f"{self.role}[{self.task_index}]",
            "replica": self.replica,
            "rank": f"{self.rank} of {self.world_size}",
            "node": f"{self.node_rank} of {self.num_nodes}",
            "local_rank": f"{self.local_rank} of {self.local_world_size}",
            "is_chief": self.is_chief,
            "chief_address": self.chief_address,
            "rendezvous_address": self.rendezvous_address,
            "trial_id": self.trial_id,
            "pools": {p.name: f"{p.role} x{len(p.addresses)}" for p in self.pools},
        }

"""The interface every cluster source implements, and the strict parsing helpers they share.

Every malformed value raises :class:`~vertexrt.errors.ClusterSpecError` naming the variable and the field.
"""

from __future__ import annotations

import json
import re
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from vertexrt.distributed.cluster_model import TRAINING_ROLES, Cluster, Pool
from vertexrt.errors import ClusterSpecError

#: Bounds on a cluster variable, checked before it is parsed: Vertex's own documents are a few KiB and nest
#: four levels deep; a huge or deep value gets a ClusterSpecError, never a RecursionError or a huge parse.
MAX_JSON_CHARS = 1 << 20
MAX_JSON_DEPTH = 32
#: Longest integer accepted in a rank, size or index: well under Python's 4300-digit ``int()`` limit.
MAX_DIGITS = 9
_STRINGS = re.compile(r'"(?:[^"\\]|\\.)*"?', re.DOTALL)


class ClusterSource(ABC):
    """One way a job describes its cluster. ``detect`` is cheap; ``read`` validates and may raise."""

    #: The value of :attr:`Cluster.source` this class produces.
    name: ClassVar[str]

    @staticmethod
    @abstractmethod
    def detect(environ: Mapping[str, str]) -> bool:
        """True when this source describes the current process."""

    @staticmethod
    @abstractmethod
    def read(environ: Mapping[str, str]) -> Cluster:
        """The cluster this source describes; :class:`ClusterSpecError` when it is malformed."""


@dataclass(frozen=True)
class ClusterJSON:
    """A parsed CLUSTER_SPEC or TF_CONFIG: pools, this task, and the training layout derived from them."""

    variable: str
    pools: tuple[Pool, ...]
    role: str
    task_index: int
    trial: str | None
    node_rank: int
    num_nodes: int
    chief_address: str

    def pool(self, role: str) -> Pool | None:
        return next((p for p in self.pools if p.role == role), None)


def parse_cluster_json(
    variable: str, text: str, pool_roles: Mapping[str, str], *, task_only_roles: tuple[str, ...] = ()
) -> ClusterJSON:
    """Parse ``{"cluster": {pool: [host:port]}, "task": {"type", "index", "trial"}}`` strictly.

    ``pool_roles`` maps each accepted pool (task type) name to its canonical role; ``task_only_roles`` may
    be a task type without being listed in ``cluster`` (TF_CONFIG never lists evaluators).
    """
    doc = load_json_object(variable, text)
    cluster = doc.get("cluster")
    if not isinstance(cluster, dict):
        raise ClusterSpecError(
            f"{variable}: field 'cluster' must be an object mapping pool names to 'host:port' lists, "
            f"got {_show(cluster)}"
        )
    pools: list[Pool] = []
    seen: dict[str, str] = {}
    roles_seen: dict[str, str] = {}
    for name, addresses in cluster.items():
        field = f"cluster.{name}"
        if name not in pool_roles:
            raise ClusterSpecError(
                f"{variable}: unknown pool {field!r}; expected one of {', '.join(sorted(pool_roles))}"
            )
        role = pool_roles[name]
        if role in roles_seen:
            raise ClusterSpecError(
                f"{variable}: cluster.{roles_seen[role]} and {field} both describe the {role} pool; keep one"
            )
        roles_seen[role] = name
        if not isinstance(addresses, list) or not addresses:
            raise ClusterSpecError(
                f"{variable}: field {field!r} must be a non-empty list of 'host:port', got {_show(addresses)}"
            )
        checked = []
        for i, address in enumerate(addresses):
            where = f"{field}[{i}]"
            checked.append(parse_address(variable, where, address))
            if checked[-1] in seen:
                raise ClusterSpecError(
                    f"{variable}: address {checked[-1]!r} appears twice, at {seen[checked[-1]]} and {where}; "
                    "every replica needs its own host:port"
                )
            seen[checked[-1]] = where
        pools.append(Pool(name=name, role=role, addresses=tuple(checked)))

    task = doc.get("task")
    if not isinstance(task, dict):
        raise ClusterSpecError(f"{variable}: field 'task' must be an object with 'type' and 'index'")
    task_type = task.get("type")
    if not isinstance(task_type, str) or task_type not in pool_roles:
        raise ClusterSpecError(
            f"{variable}: unknown task type {_show(task_type)} in field 'task.type'; "
            f"expected one of {', '.join(sorted(pool_roles))}"
        )
    role = pool_roles[task_type]
    index = parse_index(variable, "task.index", task.get("index", 0))
    own = next((p for p in pools if p.role == role), None)
    if own is None and role not in task_only_roles:
        raise ClusterSpecError(
            f"{variable}: task.type is {task_type!r} but field 'cluster' has no {task_type!r} pool"
        )
    if own is not None and index >= len(own.addresses):
        raise ClusterSpecError(
            f"{variable}: task.index {index} is out of range for cluster.{own.name}, which has "
            f"{len(own.addresses)} replica(s)"
        )
    trial = task.get("trial")
    if isinstance(trial, bool) or (trial is not None and not isinstance(trial, (str, int))):
        raise ClusterSpecError(f"{variable}: field 'task.trial' must be a string, got {_show(trial)}")

    chief = next((p for p in pools if p.role == "chief"), None)
    workers = next((p for p in pools if p.role == "worker"), None)
    if chief is not None and len(chief.addresses) != 1:
        raise ClusterSpecError(
            f"{variable}: field 'cluster.{chief.name}' lists {len(chief.addresses)} replicas; the chief "
            "(primary) pool holds exactly one"
        )
    if chief is None and workers is None:
        raise ClusterSpecError(
            f"{variable}: field 'cluster' has no chief and no worker pool, so there is no training replica"
        )
    num_chief = 1 if chief is not None else 0
    node_rank = index + (num_chief if role == "worker" else 0) if role in TRAINING_ROLES else -1
    chief_address = chief.addresses[0] if chief is not None else workers.addresses[0]  # type: ignore[union-attr]
    return ClusterJSON(
        variable=variable,
        pools=tuple(pools),
        role=role,
        task_index=index,
        trial=str(trial) if trial not in (None, "") else None,
        node_rank=node_rank,
        num_nodes=num_chief + (len(workers.addresses) if workers is not None else 0),
        chief_address=chief_address,
    )


def load_json_object(variable: str, text: str) -> dict[str, Any]:
    """``json.loads`` that names the variable and position on failure and insists on an object.

    The size and nesting depth are bounded before parsing (:data:`MAX_JSON_CHARS`, :data:`MAX_JSON_DEPTH`).
    """
    if len(text) > MAX_JSON_CHARS:
        raise ClusterSpecError(
            f"{variable} is {len(text)} characters long, more than the {MAX_JSON_CHARS} a cluster spec "
            f"needs; value starts {text[:60]!r}"
        )
    depth = deepest = 0
    for bracket in re.findall(r"[\[\]{}]", _STRINGS.sub("", text)):
        depth += 1 if bracket in "[{" else -1
        deepest = max(deepest, depth)
    if deepest > MAX_JSON_DEPTH:
        raise ClusterSpecError(
            f"{variable} is nested {deepest} levels deep, more than the {MAX_JSON_DEPTH} a cluster spec "
            f"needs; value starts {text[:60]!r}"
        )
    try:
        doc = json.loads(text)
    except ValueError as err:
        raise ClusterSpecError(f"{variable} is not valid JSON ({err}); value starts {text[:60]!r}") from None
    if not isinstance(doc, dict):
        raise ClusterSpecError(f"{variable} must be a JSON object, got {_show(doc)}")
    return doc


def parse_address(variable: str, field: str, value: object) -> str:
    """Validate ``host:port`` (IPv6 hosts in brackets) with a port in 1..65535."""
    if not isinstance(value, str):
        raise ClusterSpecError(
            f"{variable}: field {field!r} must be a 'host:port' string, got {_show(value)}"
        )
    host, sep, port = value.rpartition(":")
    if not sep or not host or host.strip() != host or any(c.isspace() for c in host):
        raise ClusterSpecError(f"{variable}: field {field!r} = {value!r} is not 'host:port'")
    parse_port(variable, field, port)
    return value


def parse_port(variable: str, field: str, value: str) -> int:
    """A port number in 1..65535 (at most 5 ASCII digits, so no huge ``int()``)."""
    if not (value.isascii() and value.isdigit() and len(value) <= 5) or not 0 < int(value) < 65536:
        raise ClusterSpecError(f"{variable}: field {field!r} has port {clip(value)}; expected 1..65535")
    return int(value)


def parse_index(variable: str, field: str, value: object) -> int:
    """A non-negative integer; a decimal string is accepted as TensorFlow does (``"1"``)."""
    if isinstance(value, str) and value.isascii() and value.isdigit() and len(value) <= MAX_DIGITS:
        return int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ClusterSpecError(
            f"{variable}: field {field!r} must be a non-negative integer, got {_show(value)}"
        )
    return value


def small_int(text: str) -> int | None:
    """``text`` as a non-negative integer of at most :data:`MAX_DIGITS` ASCII digits, else ``None``."""
    text = text.strip()
    return int(text) if text.isascii() and text.isdigit() and len(text) <= MAX_DIGITS else None


def int_env(environ: Mapping[str, str], name: str, *, minimum: int) -> int | None:
    """An integer variable (``None`` when unset); anything else is a :class:`ClusterSpecError`."""
    raw = environ.get(name)
    if raw is None:
        return None
    text = raw.strip()
    digits = text.removeprefix("-")
    if not (digits.isascii() and digits.isdigit()):
        raise ClusterSpecError(f"{name}={clip(raw)} is not an integer")
    if len(digits) > MAX_DIGITS:
        raise ClusterSpecError(f"{name}={clip(raw)} has {len(digits)} digits; expected at most {MAX_DIGITS}")
    value = int(text)
    if value < minimum:
        raise ClusterSpecError(f"{name}={clip(raw)} must be >= {minimum}")
    return value


def rendezvous_from_master(environ: Mapping[str, str], *, default_port: int | None = None) -> str | None:
    """``MASTER_ADDR:MASTER_PORT`` validated, or ``None`` when MASTER_ADDR is unset."""
    addr = environ.get("MASTER_ADDR")
    if addr is None:
        return None
    if not addr.strip() or any(c.isspace() for c in addr):
        raise ClusterSpecError(f"MASTER_ADDR={addr!r} is not a host name or IP address")
    port_text = environ.get("MASTER_PORT")
    if port_text is None:
        if default_port is None:
            return None
        return f"{addr}:{default_port}"
    return f"{addr}:{parse_port('MASTER_PORT', 'MASTER_PORT', port_text.strip())}"


def trial_id(environ: Mapping[str, str], fallback: str | None = None) -> str | None:
    """``CLOUD_ML_TRIAL_ID`` when set and non-empty, else ``fallback`` (e.g. ``task.trial``)."""
    return environ.get("CLOUD_ML_TRIAL_ID") or fallback


def clip(value: str) -> str:
    """``repr(value)``, shortened to fit an error message."""
    return repr(value) if len(value) <= 40 else f"{value[:40]!r}... ({len(value)} characters)"


def _show(value: object) -> str:
    text = (
        json.dumps(value)
        if isinstance(value, (dict, list, str, int, float, bool, type(None)))
        else repr(value)
    )
    kind = type(value).__name__
    return f"{kind} {text[:60]}"

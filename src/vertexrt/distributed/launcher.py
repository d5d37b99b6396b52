"""``python -m vertexrt.distributed.launcher ...``: the same as ``vertexrt local-run ...``.

The launcher lives in :mod:`vertexrt.distributed.local_run` (cli, replica environments, output relay,
supervisor); this module is its entry point and names its public parts.
"""

from __future__ import annotations

import sys

from vertexrt.distributed.local_run.cli import add_arguments, data_variables, main, run
from vertexrt.distributed.local_run.environments import (
    DATA_VARIABLES,
    JobSpec,
    Replica,
    port_count,
    replica_environments,
    with_this_python,
)
from vertexrt.distributed.local_run.relay import OutputRelay
from vertexrt.distributed.local_run.supervisor import Attempt, FaultNotice, FaultSource, Supervisor

__all__ = [
    "DATA_VARIABLES",
    "Attempt",
    "FaultNotice",
    "FaultSource",
    "JobSpec",
    "OutputRelay",
    "Replica",
    "Supervisor",
    "add_arguments",
    "data_variables",
    "main",
    "port_count",
    "replica_environments",
    "run",
    "with_this_python",
]

if __name__ == "__main__":
    sys.exit(main())

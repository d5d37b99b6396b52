"""``vertexrt local-run``: run a training command as an N-replica Vertex job on this machine.

Each replica gets the environment Vertex would give it: ``CLUSTER_SPEC`` (always), and on multi-replica jobs
``TF_CONFIG``, ``MASTER_ADDR``/``MASTER_PORT`` and node-level ``WORLD_SIZE``/``RANK``; ``AIP_MODEL_DIR``,
``AIP_CHECKPOINT_DIR``, ``AIP_TENSORBOARD_LOG_DIR`` under ``--base-output-dir`` (trial-scoped with
``--trial``); ``CLOUD_ML_JOB_ID``/``PROJECT_ID``/``REGION``/``TRIAL_ID``. Addresses are free loopback ports.
One variable Vertex does not set marks the simulation: ``VERTEXRT_LOCAL_RUN=1``. Each job (and trial) reports
hypertune metrics to its own ``CLOUD_ML_HP_METRIC_FILE`` under its local output directory, unless the shell
sets one. A managed-dataset job is simulated with ``--training-data``, ``--validation-data``, ``--test-data``
and ``--data-format`` (or those ``AIP_*`` variables set in the shell, passed through). Output lines are
prefixed by the Vertex replica name (``workerpool0-0``, ``workerpool1-0``; ``/<local rank>`` with several
processes per replica); after a teardown each replica's exit code is printed. The job succeeds when the chief
exits 0, as Vertex judges a job; when the chief fails, or a worker does (Vertex would restart it; here the job
fails with the worker's exit code), every replica is torn down (SIGTERM, ``--grace`` seconds, SIGKILL) with
every process it started, daemons included; a watchdog does the same if the launcher itself is killed (see
:mod:`vertexrt.distributed.reaper`). Output is relayed as it arrives, partial lines (progress bars) too.

``--workers N`` counts training replicas including the chief (workerpool0 + N-1 in workerpool1), like the
SDK's ``replica_count``. ``--processes-per-node K`` starts K processes per training replica with the variables
torchrun would set. ``--reduction-server`` lists workerpool2 replicas but runs nothing there (the real one is
Google's image); TF_CONFIG does not list them. Parameter servers and evaluators do not get ``RANK`` (their
value on Vertex is unverified).

Fault injection: ``--stagger S`` starts the replicas S seconds apart, the chief replica last, as VMs come up
on Vertex (the workers must wait for the chief's address); ``--preempt-after S`` preempts the first attempt S
seconds after it starts (SIGTERM to each replica's main process only, as a container runtime signals PID 1;
grace; SIGKILL) and restarts the whole job, unless every replica exited 0; ``--lose-vm REPLICA@SECONDS``
loses that replica's VM SECONDS into the first attempt (SIGKILL with no grace, its local disk wiped: each
replica has one, ``$VERTEXRT_LOCAL_CHECKPOINT_DIR``, kept across restarts), a failure that restarts the
whole job; ``--restarts N`` bounds restarts after a preemption or a failure (default 1 with
``--preempt-after`` or ``--lose-vm``, else 0). A replica that stops a crash loop (exit 93, see
:mod:`vertexrt.runtime.attempts`) ends the job without a restart. ``--chaos N --seed S`` certifies
that the command resumes exactly under N seeded faults (:mod:`vertexrt.distributed.chaos.driver`). A bare
``python``/``python3`` command runs as this interpreter (``sys.executable``).

Example:
    $ vertexrt local-run --workers 2 -- python train.py --lr=0.1
    $ vertexrt local-run --workers 2 --processes-per-node 2 --preempt-after 20 -- python train.py
    $ vertexrt local-run --workers 2 --stagger 5 --training-data gs://b/train.jsonl -- python train.py
    $ vertexrt local-run --workers 3 --lose-vm workerpool1-0@20 -- python train.py
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from collections.abc import Mapping, Sequence

from vertexrt.distributed.local_run.environments import DATA_VARIABLES, JobSpec, with_this_python
from vertexrt.distributed.local_run.relay import say
from vertexrt.distributed.local_run.supervisor import LostVM, Supervisor
from vertexrt.errors import ConfigError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add ``local-run``'s options to ``parser``."""
    parser.add_argument("--workers", type=_positive, default=1, help="training replicas, chief included")
    parser.add_argument("--ps", type=_non_negative, default=0, help="parameter servers (workerpool2)")
    parser.add_argument(
        "--reduction-server",
        type=_positive,
        nargs="?",
        const=1,
        default=0,
        metavar="N",
        help="list N Reduction Server replicas in workerpool2 (none runs locally)",
    )
    parser.add_argument("--evaluator", action="store_true", help="one evaluator replica (workerpool3)")
    parser.add_argument(
        "--processes-per-node",
        type=_positive,
        default=1,
        metavar="K",
        help="processes per training replica, with torchrun's variables",
    )
    parser.add_argument("--trial", default=None, help="hyperparameter-tuning trial ID (CLOUD_ML_TRIAL_ID)")
    parser.add_argument(
        "--base-output-dir",
        default=None,
        help="AIP_* directories go under it (default ./vertexrt_output/<job id>)",
    )
    parser.add_argument(
        "--job-id", default=None, help="CLOUD_ML_JOB_ID (default: a numeric ID from the clock)"
    )
    parser.add_argument(
        "--project", default=None, help="CLOUD_ML_PROJECT_ID (default: $GOOGLE_CLOUD_PROJECT)"
    )
    parser.add_argument("--region", default="us-central1", help="CLOUD_ML_REGION")
    parser.add_argument(
        "--preempt-after",
        type=_seconds,
        default=None,
        metavar="SECONDS",
        help="preempt the first attempt after SECONDS, then restart the whole job",
    )
    parser.add_argument(
        "--lose-vm",
        type=_lost_vm,
        default=None,
        metavar="REPLICA@SECONDS",
        help="lose the VM of REPLICA (workerpool1-0) SECONDS into the first attempt: SIGKILL, no grace, its "
        "local disk wiped; then restart the whole job",
    )
    parser.add_argument(
        "--restarts",
        type=_non_negative,
        default=None,
        help="whole-job restarts allowed after a preemption or failure",
    )
    parser.add_argument(
        "--grace",
        type=_seconds,
        default=15.0,
        metavar="SECONDS",
        help="seconds between SIGTERM and SIGKILL (Vertex/GKE: about 15)",
    )
    parser.add_argument(
        "--stagger",
        type=_seconds,
        default=0.0,
        metavar="SECONDS",
        help="start the replicas SECONDS apart, the chief last (VMs come up minutes apart on Vertex)",
    )
    chaos = parser.add_argument_group("fault certificate (see vertexrt.distributed.chaos.driver)")
    chaos.add_argument(
        "--chaos",
        type=_positive,
        default=None,
        metavar="N",
        help="run once without faults, then N times under seeded faults, and compare with the first",
    )
    chaos.add_argument("--seed", type=int, default=0, help="the fault schedule's seed (with --chaos)")
    chaos.add_argument("--chaos-report", metavar="FILE", help="write the certificate as JSON to FILE")
    chaos.add_argument(
        "--chaos-rtol",
        type=_seconds,
        default=None,
        metavar="X",
        help="relative tolerance for numbers in model files that differ and parse (JSON, NumPy, torch)",
    )
    data = parser.add_argument_group("managed dataset (what Vertex sets for a managed-dataset job)")
    data.add_argument("--training-data", metavar="URI", help="AIP_TRAINING_DATA_URI")
    data.add_argument("--validation-data", metavar="URI", help="AIP_VALIDATION_DATA_URI")
    data.add_argument("--test-data", metavar="URI", help="AIP_TEST_DATA_URI")
    data.add_argument(
        "--data-format", metavar="FORMAT", help="AIP_DATA_FORMAT (jsonl, csv, tf-record, bigquery...)"
    )
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- the training command")


def run(args: argparse.Namespace) -> int:
    """Run the job described by ``args`` (from :func:`add_arguments`); returns the job's exit code."""
    command = list(args.command)
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        raise ConfigError(
            "local-run: no command given; usage: vertexrt local-run --workers 2 -- python train.py"
        )
    command = with_this_python(command)
    if args.ps and args.reduction_server:
        raise ConfigError("local-run: --ps and --reduction-server both use workerpool2; choose one")
    if not 0 <= args.stagger <= 3600:
        raise ConfigError(f"local-run: --stagger {args.stagger:g}: give seconds between 0 and 3600")
    job = JobSpec(
        command=command,
        workers=args.workers,
        ps=args.ps,
        reduction_servers=args.reduction_server,
        evaluators=1 if args.evaluator else 0,
        processes_per_node=args.processes_per_node,
        trial=args.trial,
        job_id=args.job_id or str(int(time.time() * 1000)),
        project=args.project
        or os.environ.get("GOOGLE_CLOUD_PROJECT")
        or os.environ.get("CLOUDSDK_CORE_PROJECT")
        or "local-project",
        region=args.region,
        base_output_dir=args.base_output_dir,
        data=data_variables(args, os.environ),
        stagger=args.stagger,
    )
    if args.lose_vm is not None:
        training = ["workerpool0-0", *(f"workerpool1-{i}" for i in range(job.workers - 1))]
        if args.lose_vm.replica not in training:
            raise ConfigError(
                f"local-run: --lose-vm {args.lose_vm.replica}@{args.lose_vm.seconds:g}: no such training "
                f"replica in this job; choose one of {', '.join(training)}"
            )
    if args.chaos is not None:
        if args.preempt_after is not None or args.lose_vm is not None or args.trial:
            raise ConfigError(
                "local-run: --chaos places its own faults; leave out --preempt-after, --lose-vm and --trial"
            )
        from vertexrt.distributed.chaos.driver import Options, certify

        options = Options(args.chaos, args.seed, args.grace, args.chaos_rtol, args.chaos_report)
        return certify(job, options)
    faulted = args.preempt_after is not None or args.lose_vm is not None
    restarts = args.restarts if args.restarts is not None else (1 if faulted else 0)
    return Supervisor(
        job, grace=args.grace, preempt_after=args.preempt_after, restarts=restarts, lose_vm=args.lose_vm
    ).run()


def data_variables(args: argparse.Namespace, environ: Mapping[str, str]) -> dict[str, str]:
    """The managed-dataset variables: each flag given, else the variable the user set in the environment
    (said on a line of its own, as a replica would otherwise seem to invent it)."""
    data = {}
    for option, name in DATA_VARIABLES.items():
        value = getattr(args, option, None)
        if value is not None:
            if not value.strip():
                flag = "--" + option.replace("_", "-")
                raise ConfigError(f"local-run: {flag} is empty: give a value or leave it out")
            data[name] = value
        elif environ.get(name):
            data[name] = environ[name]
            say(f"passing {name}={environ[name]} from your environment to every replica")
    return data


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text}")
    return value


def _seconds(text: str) -> float:
    value = float(text)
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"expected a finite number of seconds >= 0, got {text!r}")
    return value


def _lost_vm(text: str) -> LostVM:
    replica, at, seconds = text.rpartition("@")
    if not at or not replica:
        raise argparse.ArgumentTypeError(f"expected REPLICA@SECONDS (workerpool1-0@30), got {text!r}")
    return LostVM(replica, _seconds(seconds))


def _non_negative(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected a non-negative integer, got {text}")
    return value


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m vertexrt.distributed.launcher ...`` (the same as ``vertexrt local-run ...``)."""
    parser = argparse.ArgumentParser(prog="vertexrt local-run", description=__doc__.splitlines()[0])
    add_arguments(parser)
    try:
        return run(parser.parse_args(argv))
    except ConfigError as err:
        print(f"vertexrt local-run: error: {err}", file=sys.stderr)
        return 2

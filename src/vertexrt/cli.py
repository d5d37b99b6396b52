"""The ``vertexrt`` command: ``info``, ``doctor``, ``gcs-server`` and ``local-run``.

Example:
    $ vertexrt info --json
    $ vertexrt doctor            # exit status 1 when a fatal problem would stop the job
    $ vertexrt gcs-server --bucket my-bucket
    $ vertexrt local-run --workers 2 -- python train.py --lr=0.1
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
from collections.abc import Sequence
from typing import Any
from warnings import catch_warnings, simplefilter

from vertexrt.errors import VertexrtError

_MAX_SHOWN = 2000


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``vertexrt`` console script."""
    parser = argparse.ArgumentParser(prog="vertexrt", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)

    info = commands.add_parser("info", help="print the Vertex contract this process sees")
    info.add_argument("--json", action="store_true", help="machine-readable output")
    info.set_defaults(run=_info)

    doctor = commands.add_parser(
        "doctor", help="check outputs, mounts, credentials, data, GPUs, shared memory, disk and NCCL"
    )
    doctor.add_argument("--json", action="store_true", help="machine-readable output")
    doctor.add_argument(
        "--timeout", type=float, default=10.0, help="seconds for all checks together (default 10)"
    )
    doctor.set_defaults(run=_doctor)

    server = commands.add_parser("gcs-server", help="run a local GCS-compatible server until interrupted")
    server.add_argument("--port", type=int, default=None)
    server.add_argument("--bucket", action="append", default=[], help="bucket to create (repeatable)")
    server.set_defaults(run=_gcs_server)

    local_run = commands.add_parser(
        "local-run", help="run a training command as an N-replica Vertex job on this machine"
    )
    try:
        from vertexrt.distributed import launcher
    except ImportError:  # the launcher is optional until the distributed package is installed
        local_run.set_defaults(run=lambda _args: _fail("local-run is not available in this build"))
    else:
        launcher.add_arguments(local_run)
        local_run.set_defaults(run=launcher.run)

    args = parser.parse_args(argv)
    try:
        return int(args.run(args))
    except VertexrtError as err:
        return _fail(str(err))


def _fail(message: str) -> int:
    print(f"vertexrt: error: {message}", file=sys.stderr)
    return 2


def info_report() -> dict[str, Any]:
    """What ``vertexrt info`` shows: environment, cluster, raw variables and warnings.

    It reports, never raises: whatever reading the contract raises becomes a warning. URIs are shown with
    embedded credentials masked (:func:`vertexrt.paths.redact`).

    Example:
        >>> info_report()["warnings"]
        []
    """
    import os

    from vertexrt.env import CONTRACT_VARIABLES, environment

    report: dict[str, Any] = {"environment": None, "cluster": None, "variables": {}, "warnings": []}
    report["local_run"] = bool(os.environ.get("VERTEXRT_LOCAL_RUN"))
    warnings: list[str] = report["warnings"]
    report["variables"] = {
        name: _shown(os.environ[name]) for name in CONTRACT_VARIABLES if name in os.environ
    }
    try:
        env = environment()
    except Exception as err:  # noqa: BLE001 - info reports whatever the library raises
        warnings.append(_problem("the environment", err))
    else:
        fields = env.as_dict()
        del fields["variables"]
        report["environment"] = {k: _shown(v) for k, v in fields.items()} | {"on_vertex": env.on_vertex}
    report["cluster"] = _cluster_summary(warnings)
    try:
        from vertexrt.doctor import contract_warnings

        warnings += contract_warnings()
    except Exception as err:  # noqa: BLE001
        warnings.append(_problem("the contract checks", err))
    return report


def _cluster_summary(warnings: list[str]) -> dict[str, Any] | None:
    from vertexrt.distributed import cluster

    with catch_warnings(record=True) as caught:  # CLUSTER_SPEC / TF_CONFIG / RANK disagreements
        simplefilter("always")
        try:
            summary: dict[str, Any] | None = cluster().summary()
        except Exception as err:  # noqa: BLE001 - info reports whatever the library raises
            summary = None
            warnings.append(
                _problem(
                    "the cluster (CLUSTER_SPEC, TF_CONFIG, MASTER_ADDR/MASTER_PORT, RANK/WORLD_SIZE)", err
                )
            )
    warnings.extend(_shown(str(w.message)) for w in caught)
    return summary


def _problem(what: str, err: Exception) -> str:
    """A warning line for ``err``; an error that is not a VertexrtError is named by its type."""
    text = (
        str(err)
        if isinstance(err, VertexrtError)
        else f"{what} could not be read: {type(err).__name__}: {err}"
    )
    return _shown(text)


def _shown(value: Any) -> Any:
    """``value`` with credentials in URIs masked and long text cut, for printing."""
    if not isinstance(value, str):
        return value
    from vertexrt.paths import redact

    text = " ".join(redact(word) for word in value.split(" "))
    return text if len(text) <= _MAX_SHOWN else f"{text[:_MAX_SHOWN]}... ({len(text)} characters)"


def _info(args: argparse.Namespace) -> int:
    report = info_report()
    if args.json:
        print(json.dumps(report, indent=2, sort_keys=True, default=str))
        return 0
    for section in ("environment", "cluster"):
        values = report[section]
        if not values:
            continue
        print(f"{section}:")
        width = max(len(k) for k in values)
        for key, value in values.items():
            print(f"  {key:<{width}}  {value}")
    print("variables:")
    for key, value in report["variables"].items():
        print(f"  {key}={value}")
    if report["environment"] and not report["environment"]["on_vertex"]:
        print("note: not inside a Vertex job (no CLOUD_ML_JOB_ID or CLUSTER_SPEC): a local run")
    elif report["local_run"]:
        print("note: a `vertexrt local-run` simulation of a Vertex job: outputs stay on this machine")
    for warning in report["warnings"]:
        print(f"warning: {warning}")
    return 0


def _doctor(args: argparse.Namespace) -> int:
    from vertexrt.doctor import check, render

    if not 0 < args.timeout <= 600:
        return _fail(f"--timeout {args.timeout:g}: give a number of seconds > 0 and <= 600")
    findings = check(timeout=args.timeout)
    if args.json:
        print(json.dumps([f.as_dict() for f in findings], indent=2))
    else:
        print(render(findings))
    return 1 if any(f.severity == "fatal" for f in findings) else 0


def _gcs_server(args: argparse.Namespace) -> int:
    from vertexrt.emulator import GCSServer

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # before start: never orphan the server
    server = GCSServer(buckets=args.bucket, port=args.port)
    try:
        server.start()
        print(f"export STORAGE_EMULATOR_HOST={server.endpoint}")
        print("export GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT=false")
        buckets = ", ".join(args.bucket) or "(none)"
        print(f"# buckets: {buckets}; log: {server.log_path}; Ctrl-C stops it", flush=True)
        signal.pause()
    except (KeyboardInterrupt, SystemExit):
        pass
    finally:
        server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())

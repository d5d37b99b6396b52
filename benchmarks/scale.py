"""Storage requests per rank at scale: sharded save + commit, restore of the newest step, equalize counting.

Two measurements, both against the Cloud Storage test server (fake-gcs-server) through a counting proxy
(``benchmarks/countingproxy.py``) that records every request's kind (list / metadata / read / write /
delete) and bytes, per rank and operation (an ``X-Scale-Tag`` header on each rank's gcsfs session):

- **real**: N gloo ranks (CPU processes, ``--real 1,2,4,8``);
- **sim**: N ranks as threads of one process (``--sim 64,256,1024``) sharing a fake ``torch.distributed``
  (``benchmarks/threadworld.py``: every collective vertexrt calls, over thread barriers), each rank with
  its own gcsfs session, and a fixed ``--latency`` (1 ms) added to every request. Python allocations per
  rank are tracemalloc's peak during the operation divided by N.

Each rank runs vertexrt's public API only: ``CheckpointManager(gs://..., rank, world_size)`` saves a small
state with ``save(step, state, shard=rank)`` (a first save, not measured, then the measured one), a fresh
manager restores the newest step, and ``open_dataset(64 JSONL files, equalize="drop_remainder")
.epoch_length()`` counts the records. One table per operation: requests (total, by kind, per rank), bytes
per rank, their growth from the first row of the same mode, and the seconds the requests would take at
the per-bucket Cloud Storage limits (~5,000 object reads/s, ~1,000 writes/s to start; listing is
expensive: shared/reference/resilience-and-scale.md). Then the stop vote: one all-reduce of its two
integers timed on the real gloo ranks, and a ring / tree / by-node model of it to 1,024 ranks.

Request counts are deterministic except where the code polls storage (the commit's wait for shard
records); timings are not, and nothing here asserts them.

Run: ``PYTHONPATH=src .venv/bin/python benchmarks/scale.py [--quick] [--real 1,2,4,8] [--sim 64,256,1024]
[--latency 0.001] [--json out.json]``. ``--quick``: real 1,2, sim 1,2 and 8 files (a smoke test).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import tracemalloc
import uuid
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any
from urllib.parse import parse_qs, urlsplit

os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from countingproxy import KINDS, TAG_HEADER, ProxyProcess, Record  # noqa: E402

BUCKET = "vertexrt-scale"
OPERATIONS = {
    "save": "sharded save + commit",
    "restore": "restore of the newest step",
    "count": "equalize counting",
}
FILES, RECORDS_PER_FILE = 64, 32  # --files 8 with --quick
READS_PER_S, WRITES_PER_S = 5000, 1000  # per-bucket Cloud Storage starting limits (reference file)
VOTE_ROUNDS = 200
MIB = 1 << 20


# -- one rank's work (the same code for a gloo process and a simulated thread) -------------------------------


class Tags:
    """The ``operation/rank`` tag of the calling thread: its rank's current operation (``rank_of()`` names the
    calling thread's rank, so threads a rank starts are tagged as that rank)."""

    def __init__(self, rank_of: Callable[[], int | None]) -> None:
        self._rank_of = rank_of
        self._operation: dict[int, str] = {}

    def set(self, operation: str, rank: int) -> None:
        self._operation[rank] = operation

    def get(self) -> str:
        rank = self._rank_of()
        return "untagged/0" if rank is None else f"{self._operation.get(rank, 'untagged')}/{rank}"


@contextmanager
def counted_storage(endpoint: str, tags: Tags) -> Iterator[None]:
    """``vertexrt.paths.gcs_filesystem`` returns a gcsfs instance per tag, talking to ``endpoint`` with the
    tag in a header: the proxy attributes each request to a rank and an operation."""
    from gcsfs.core import GCSFileSystem

    import vertexrt.paths
    from vertexrt.clients import storage_options

    instances: dict[str, Any] = {}
    lock = threading.Lock()

    def gcs_filesystem() -> Any:
        tag = tags.get()
        with lock:
            if tag not in instances:
                options = {**storage_options(), "endpoint_url": endpoint, "token": "anon"}
                instances[tag] = GCSFileSystem(
                    **options, session_kwargs={"headers": {TAG_HEADER: tag}}, skip_instance_cache=True
                )
            return instances[tag]

    original = vertexrt.paths.gcs_filesystem
    vertexrt.paths.gcs_filesystem = gcs_filesystem  # type: ignore[assignment]
    try:
        yield
    finally:
        vertexrt.paths.gcs_filesystem = original  # type: ignore[assignment]


def rank_state(rank: int) -> dict[str, Any]:
    """A small Trainer-like state: a few tensors, an optimizer-like dict, the step."""
    import torch

    gen = torch.Generator().manual_seed(rank)
    return {
        "model": {f"layer{i}.weight": torch.rand(256, generator=gen) for i in range(4)},
        "opt": {"state": {i: {"exp_avg": torch.zeros(256)} for i in range(2)}, "lr": 1e-3},
        "step": 0,
    }


def rank_main(
    rank: int,
    world_size: int,
    root: str,
    data: str,
    files: int,
    tags: Tags,
    barrier: Callable[[], None],
    hooks: Any,
    skip: frozenset[str] = frozenset(),
) -> dict[str, float]:
    """Every operation but ``skip`` on this rank, separated by barriers; this rank's seconds per operation."""
    from vertexrt.checkpoint import CheckpointManager
    from vertexrt.data import open_dataset

    seconds: dict[str, float] = {}

    def timed(operation: str, fn: Callable[[], Any]) -> Any:
        barrier()
        if rank == 0:
            hooks.start(operation)
        barrier()
        tags.set(operation, rank)
        started = time.perf_counter()
        result = fn()
        seconds[operation] = time.perf_counter() - started
        tags.set("between", rank)
        barrier()
        if rank == 0:
            hooks.end(operation)
        return result

    def save(step: int) -> None:
        manager = CheckpointManager(root, rank=rank, world_size=world_size, async_save=False)
        state = rank_state(rank)
        state["step"] = step
        manager.save(step, state, shard=rank, force=True)
        manager.close()

    def restore() -> int:
        manager = CheckpointManager(root, rank=rank, world_size=world_size, async_save=False)
        restored = manager.restore()
        manager.close()
        assert restored is not None and restored["step"] == 2, f"rank {rank} restored {restored!r}"
        return 2

    def count() -> int:
        dataset = open_dataset(
            data, rank=rank, world_size=world_size, equalize="drop_remainder", shuffle=False
        )
        length = dataset.epoch_length()
        assert length == files * RECORDS_PER_FILE // world_size, f"rank {rank}: epoch_length {length}"
        return length

    timed("first_save", lambda: save(1))
    timed("save", lambda: save(2))
    if "restore" not in skip:
        timed("restore", restore)
    if "count" not in skip:
        timed("count", count)
    return seconds


class NoHooks:
    def start(self, operation: str) -> None:
        pass

    def end(self, operation: str) -> None:
        pass


class AllocationHooks:
    """tracemalloc's peak above the level at the start of each operation (all rank threads together)."""

    def __init__(self) -> None:
        self.peak: dict[str, int] = {}
        self._base = 0

    def start(self, operation: str) -> None:
        tracemalloc.reset_peak()
        self._base = tracemalloc.get_traced_memory()[0]

    def end(self, operation: str) -> None:
        self.peak[operation] = tracemalloc.get_traced_memory()[1] - self._base


# -- the real run: N gloo processes --------------------------------------------------------------------------


def worker(
    rank: int, world_size: int, port: int, files: int, root: str, data: str, endpoint: str, out: str
) -> None:
    """One gloo rank (``--worker``): the operations, then the vote's all-reduce timed."""
    import torch
    import torch.distributed as dist

    if world_size > 1:
        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size
        )
    barrier = dist.barrier if world_size > 1 else (lambda: None)
    tags = Tags(lambda: rank)
    with counted_storage(endpoint, tags):
        seconds = rank_main(rank, world_size, root, data, files, tags, barrier, NoHooks())
    vote: list[float] = []
    if world_size > 1:
        flags = torch.zeros(2, dtype=torch.int64)  # what StopVote all-reduces: [flag, -calls between votes]
        for i in range(VOTE_ROUNDS + 20):
            started = time.perf_counter()
            dist.all_reduce(flags, op=dist.ReduceOp.MAX)
            if i >= 20:
                vote.append(time.perf_counter() - started)
        dist.barrier()
        dist.destroy_process_group()
    with open(out, "w") as f:
        json.dump({"seconds": seconds, "vote": vote}, f)


def run_real(world_size: int, endpoint: str, data: str, files: int, workdir: str) -> list[dict[str, Any]]:
    from vertexrt._net import free_port

    root = f"gs://{BUCKET}/real-{world_size}-{uuid.uuid4().hex[:8]}"
    port = free_port()
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    outs = [os.path.join(workdir, f"real-{world_size}-{rank}.json") for rank in range(world_size)]
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                os.path.abspath(__file__),
                "--worker",
                str(rank),
                str(world_size),
                str(port),
                str(files),
                root,
                data,
                endpoint,
                outs[rank],
            ],
            env=env,
        )
        for rank in range(world_size)
    ]
    deadline = time.monotonic() + 600
    try:
        for proc in procs:
            code = proc.wait(max(1.0, deadline - time.monotonic()))
            if code != 0:
                raise RuntimeError(f"a real rank of {world_size} exited with {code}")
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    results = []
    for out in outs:
        with open(out) as f:
            results.append(json.load(f))
    return results


# -- the simulation: N threads -------------------------------------------------------------------------------


def run_sim(
    world_size: int, endpoint: str, data: str, files: int, skip: frozenset[str]
) -> tuple[list[dict[str, float]], dict[str, int]]:
    import torch  # noqa: F401 - loaded before the fake world replaces torch.distributed
    from threadworld import ThreadWorld

    # every rank's requests go through one gcsfs event loop here: a request waits behind the others
    os.environ["VERTEXRT_STORAGE_TIMEOUT"] = os.environ["VERTEXRT_STORAGE_LIST_TIMEOUT"] = "3600"
    root = f"gs://{BUCKET}/sim-{world_size}-{uuid.uuid4().hex[:8]}"
    world, hooks = ThreadWorld(world_size), AllocationHooks()
    tags = Tags(world.current_rank)
    stack = threading.stack_size(1 << 20)  # 1,024 threads: small stacks
    tracemalloc.start()
    try:
        with world.installed(), counted_storage(endpoint, tags):
            seconds = world.run(
                lambda rank: rank_main(rank, world_size, root, data, files, tags, world.barrier, hooks, skip)
            )
    finally:
        tracemalloc.stop()
        threading.stack_size(stack)
    return seconds, hooks.peak


# -- tables --------------------------------------------------------------------------------------------------


def summarise(records: list[Record], operation: str, world_size: int) -> dict[str, Any]:
    """Counts of one operation's requests: by kind, per rank (mean, max, rank 0), bytes per rank."""
    mine = [r for r in records if r.tag.split("/")[0] == operation]
    per_rank: dict[int, list[Record]] = defaultdict(list)
    for record in mine:
        per_rank[int(record.tag.split("/")[1])].append(record)
    requests = [len(per_rank.get(rank, [])) for rank in range(world_size)]
    sent = [sum(r.bytes for r in per_rank.get(rank, [])) for rank in range(world_size)]
    by_kind = {kind: sum(1 for r in mine if r.kind == kind) for kind in KINDS}
    probes = sum(
        1 for r in mine if r.kind == "list" and parse_qs(urlsplit(r.target).query).get("maxResults") == ["1"]
    )
    reads = by_kind["list"] + by_kind["metadata"] + by_kind["read"]
    writes = by_kind["write"] + by_kind["delete"]
    return {
        "requests": len(mine),
        **by_kind,
        "probes": probes,
        "per_rank_mean": statistics.fmean(requests),
        "per_rank_max": max(requests),
        "chief": requests[0],
        "other_max": max(requests[1:], default=0),
        "bytes_mean": statistics.fmean(sent),
        "bytes_other_max": max(sent[1:], default=sent[0]),
        "limit_s": max(reads / READS_PER_S, writes / WRITES_PER_S),
    }


def _alloc(row: dict[str, Any], operation: str) -> str:
    peak = row["alloc"].get(operation)
    return "-" if peak is None else f"{peak / MIB / row['n']:.2f}"


# (header, width, cell(row, stats of the operation, requests per rank of the first row of the mode))
COLUMNS: list[tuple[str, int, Callable[[dict[str, Any], dict[str, Any], float], str]]] = [
    ("mode", 5, lambda row, s, base: row["mode"]),
    ("N", 5, lambda row, s, base: str(row["n"])),
    ("requests", 9, lambda row, s, base: str(s["requests"])),
    *((kind[:5], 6, lambda row, s, base, kind=kind: str(s[kind])) for kind in KINDS),
    ("probes", 6, lambda row, s, base: str(s["probes"])),
    ("req/rank", 9, lambda row, s, base: f"{s['per_rank_mean']:.1f}"),
    ("chief", 6, lambda row, s, base: str(s["chief"])),
    ("other max", 9, lambda row, s, base: str(s["other_max"])),
    ("KB/rank", 9, lambda row, s, base: f"{s['bytes_mean'] / 1024:.1f}"),
    ("KB other", 9, lambda row, s, base: f"{s['bytes_other_max'] / 1024:.1f}"),
    ("growth", 7, lambda row, s, base: f"{s['per_rank_mean'] / base:.2f}x"),
    ("MB alloc/rank", 13, lambda row, s, base: _alloc(row, s["operation"])),
    ("s rank0", 8, lambda row, s, base: f"{row['seconds'][s['operation']]:.3f}"),
    ("s @limits", 9, lambda row, s, base: f"{s['limit_s']:.3f}"),
]

LEGEND = (
    "req/rank: mean over ranks; chief: rank 0; other max: the busiest other rank; KB/rank: request + "
    "response "
    "bodies (KB other: the busiest other rank); growth: req/rank over the first row of the same mode; "
    "s @limits: the requests' time at one bucket's starting limits, ~{reads:,} object reads/s (list + "
    "metadata + read) and ~{writes:,} writes/s (write + delete), shared/reference/resilience-and-scale.md "
    "(listing is expensive); sim: threads with a fake torch.distributed and {latency:g} s per request; "
    "MB alloc/rank: tracemalloc's peak / N; s rank0: rank 0's seconds (not comparable between real and sim). "
    "probes (in list): gcsfs's info() sends a 1-result list beside each metadata GET and cancels it when the "
    "GET answers: whether it reaches the server is a race, so these vary a little from run to run, as do "
    "the chief's lists while a sharded commit polls for the shard records."
)


def print_tables(rows: list[dict[str, Any]], latency: float) -> None:
    for operation, title in OPERATIONS.items():
        print(f"\n## {title} (requests through the counting proxy; all ranks)")
        header = " ".join(f"{name:>{width}}" for name, width, _ in COLUMNS)
        print(header)
        print("-" * len(header))
        first: dict[str, float] = {}
        for row in rows:
            if operation not in row["ops"]:  # skipped in that run (--sim-skip)
                continue
            stats = {**row["ops"][operation], "operation": operation}
            base = first.setdefault(row["mode"], stats["per_rank_mean"] or 1.0)
            print(" ".join(f"{cell(row, stats, base):>{width}}" for _, width, cell in COLUMNS))
    print("\n" + LEGEND.format(reads=READS_PER_S, writes=WRITES_PER_S, latency=latency))


def vote_table(real_rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The vote's all-reduce measured on the real ranks, and a model of ring / tree / by-node to 1,024."""
    from vertexrt.preemption.vote import LATENCY_FACTOR, VOTE_INTERVAL

    measured = {row["n"]: row["vote_ms"] for row in real_rows if row["vote_ms"] is not None}
    if not measured:
        return {}
    print("\n## stop vote: one all-reduce of 2 int64 (gloo, CPU), median of", VOTE_ROUNDS)
    for n, ms in sorted(measured.items()):
        print(f"real N={n:<4} {ms:8.3f} ms")
    # hop latency: least squares of t = a + 2(N-1) h over the measured N (one hop when only N=2 ran)
    points = sorted(measured.items())
    if len(points) >= 2:
        xs = [2 * (n - 1) for n, _ in points]
        ys = [ms for _, ms in points]
        mx, my = statistics.fmean(xs), statistics.fmean(ys)
        slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sum((x - mx) ** 2 for x in xs)
        hop = max(slope, 1e-3)
        base = max(my - hop * mx, 0.0)
    else:
        hop, base = points[0][1] / 2, 0.0
    print(f"model: t = {base:.3f} ms + hops x {hop:.3f} ms (fit over the real N)")
    print(
        f"{'N':>6} {'ring ms':>9} {'tree ms':>9} {'by node ms':>11} {'interval s':>11} {'loop wait ms':>13} "
        f"{'first vote ms':>14} {'stop after s':>13}"
    )
    model = {}
    for n in (8, 64, 256, 1024):
        ring = base + 2 * (n - 1) * hop
        tree = base + 2 * math.ceil(math.log2(n)) * hop
        nodes = max(1, n // 8)
        by_node = base + (2 * 3 + 2 * (nodes - 1)) * hop  # a tree over 8 local ranks, a ring over nodes
        interval = max(VOTE_INTERVAL, LATENCY_FACTOR * ring / 1000)
        # the vote is read a whole interval after it started: the loop waits only for what is left of it
        wait = max(0.0, ring - interval * 1000)
        first = max(0.0, ring - VOTE_INTERVAL * 1000)  # before its latency is known, paced by the interval
        model[n] = {"ring_ms": ring, "tree_ms": tree, "by_node_ms": by_node, "interval_s": interval}
        print(
            f"{n:>6} {ring:>9.2f} {tree:>9.2f} {by_node:>11.2f} {interval:>11.2f} {wait:>13.2f} "
            f"{first:>14.2f} {2 * interval + ring / 1000:>13.2f}"
        )
    print(
        f"interval: the ring's vote interval at the {LATENCY_FACTOR}x pace; loop wait: what a vote's read "
        "waits (the all-reduce runs async_op and is read one interval later); first vote: what the first "
        "read waits, once (its latency is not known yet); stop after: the notice's worst case to the stop"
    )
    return {"measured_ms": measured, "hop_ms": hop, "base_ms": base, "model": model}


# -- main ----------------------------------------------------------------------------------------------------


def write_data(endpoint: str, files: int) -> str:
    from gcsfs.core import GCSFileSystem

    fs = GCSFileSystem(endpoint_url=endpoint, token="anon", skip_instance_cache=True)
    for i in range(files):
        lines = "".join(json.dumps({"file": i, "record": j}) + "\n" for j in range(RECORDS_PER_FILE))
        fs.pipe_file(f"{BUCKET}/data/part-{i:03d}.jsonl", lines.encode())
    return f"gs://{BUCKET}/data/*.jsonl"


def measure(
    real: list[int],
    sim: list[int],
    latency: float,
    files: int,
    json_to: str | None = None,
    records_to: str | None = None,
    sim_skip: frozenset[str] = frozenset(),
) -> list[dict[str, Any]]:
    """One row per run; with ``json_to``, the rows so far are written there after each run, and with
    ``records_to`` every request (JSON lines)."""
    from vertexrt.emulator import GCSServer

    rows: list[dict[str, Any]] = []
    dump = open(records_to, "w") if records_to else None  # noqa: SIM115 - open across the runs
    with tempfile.TemporaryDirectory() as workdir:
        server = GCSServer(buckets=[BUCKET], log_path=os.path.join(workdir, "gcs.log")).start()
        try:
            os.environ["STORAGE_EMULATOR_HOST"] = server.endpoint
            data = write_data(server.endpoint, files)
            with ProxyProcess(("127.0.0.1", server.port), label="real") as proxy:
                for n in real:
                    proxy.clear()
                    results = run_real(n, proxy.endpoint, data, files, workdir)
                    records = proxy.records()
                    _dump(dump, "real", n, records)
                    rows.append(_row("real", n, records, [r["seconds"] for r in results], {}, results[0]))
                    _save(json_to, rows, latency, files)
            with ProxyProcess(("127.0.0.1", server.port), delay=latency, label="sim") as proxy:
                for n in sim:
                    proxy.clear()
                    seconds, alloc = run_sim(n, proxy.endpoint, data, files, sim_skip)
                    records = proxy.records()
                    _dump(dump, "sim", n, records)
                    rows.append(_row("sim", n, records, seconds, alloc, None))
                    _save(json_to, rows, latency, files)
        finally:
            server.stop()
            if dump is not None:
                dump.close()
    return rows


def _save(path: str | None, rows: list[dict[str, Any]], latency: float, files: int) -> None:
    row = rows[-1]
    print(f"[{row['mode']} N={row['n']} done]", file=sys.stderr)
    if path:
        with open(path, "w") as f:
            json.dump({"rows": rows, "latency": latency, "files": files}, f, indent=1)


def report(rows: list[dict[str, Any]], latency: float) -> dict[str, Any]:
    """The tables of ``rows``, and the vote's (from the real rows)."""
    print_tables(rows, latency)
    return vote_table([r for r in rows if r["mode"] == "real"])


def _dump(dump: Any, mode: str, n: int, records: list[Record]) -> None:
    for record in records if dump is not None else ():
        dump.write(json.dumps({"mode": mode, "n": n, **record._asdict()}) + "\n")


def _row(
    mode: str,
    n: int,
    records: list[Record],
    seconds: list[dict[str, float]],
    alloc: dict[str, int],
    first: Any,
) -> dict[str, Any]:
    vote = first["vote"] if first else []
    return {
        "mode": mode,
        "n": n,
        "ops": {
            operation: summarise(records, operation, n) for operation in OPERATIONS if operation in seconds[0]
        },
        "seconds": {operation: seconds[0][operation] for operation in OPERATIONS if operation in seconds[0]},
        "alloc": alloc,
        "vote_ms": statistics.median(vote) * 1000 if vote else None,
        "untagged": sum(
            1 for r in records if r.tag.split("/")[0] not in (*OPERATIONS, "first_save", "between")
        ),
    }


def _sizes(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v.strip()]


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        rank, world_size, port, files = (int(v) for v in sys.argv[2:6])
        worker(rank, world_size, port, files, *sys.argv[6:10])
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="real 1,2, sim 1,2 and 8 files: a smoke test")
    parser.add_argument("--files", type=int, default=None, help=f"data files to count (default {FILES})")
    parser.add_argument("--real", type=_sizes, default=None, help="gloo process counts (default 1,2,4,8)")
    parser.add_argument(
        "--sim", type=_sizes, default=None, help="simulated rank counts (default 64,256,1024)"
    )
    parser.add_argument("--latency", type=float, default=0.001, help="seconds added per request in the sim")
    parser.add_argument("--json", help="also write the rows here")
    parser.add_argument("--records", help="also write every request here (JSON lines)")
    parser.add_argument("--sim-skip", default="", help="operations the simulation leaves out, e.g. restore")
    parser.add_argument("--print", nargs="+", metavar="JSON", help="print the tables of earlier --json runs")
    args = parser.parse_args()
    real = args.real if args.real is not None else ([1, 2] if args.quick else [1, 2, 4, 8])
    sim = args.sim if args.sim is not None else ([1, 2] if args.quick else [64, 256, 1024])
    files = args.files if args.files is not None else (8 if args.quick else FILES)
    if args.print:
        runs = [json.load(open(path)) for path in args.print]  # noqa: SIM115 - read whole at once
        report([row for run in runs for row in run["rows"]], runs[0]["latency"])
        return
    rows = measure(
        real, sim, args.latency, files, args.json, args.records, frozenset(args.sim_skip.split(","))
    )
    vote = report(rows, args.latency)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows, "vote": vote, "latency": args.latency, "files": files}, f, indent=1)


if __name__ == "__main__":
    main()

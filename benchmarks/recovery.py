"""Recovery with the fast checkpoint tier against a durable-only baseline at the same blocking budget.

Three real gloo CPU ranks (each its own "VM" with its own local directory), a state of ``--mib`` MiB per
rank, a simulated ``--step-ms`` step, the durable tier on the GCS test server (fake-gcs-server) behind a
loopback relay that counts the bytes the server sends and can throttle both directions. Scenarios:

- **one VM lost**: rank 1 is SIGKILLed after step ``--die-at`` and its local disk wiped; the job restarts;
- **two VMs lost**: ranks 1 and 2 (one peer group: rank 1's copies live on rank 2) lose their disks;
- **SIGTERM, 30 s grace**: rank 1 gets SIGTERM after step ``--die-at`` and from then on the server is
  throttled to ``--throttle-mbs`` MB/s; every rank makes its emergency save; every rank still running when
  the grace ends is SIGKILLed; then the VM is gone (disk wiped) and the job restarts.

Per scenario and configuration: the steps lost (last step done - step resumed from), seconds from the
restart's launch to the end of its first step, bytes read from the server during the restart, and the
blocking of ``save()`` as a share of the step time. The fast configuration saves fast every ``--fast-every``
and durable every ``--durable-every`` steps; the baseline saves durable only, every k' steps, with k' derived
at run time (:func:`same_budget`, each measurement printed above the table): ceil(seconds one durable save
blocks, measured in a durable-only run of the same state on the same storage saving every
``--calibrate-every`` steps / seconds the fast configuration blocks per step, measured in its own run); then
checked by a durable-only run at k' itself, since a save waits for the previous one when saves come faster
than they are written (:func:`next_every`). The table shows both blockings as measured.

``--kills N`` runs the durability check instead of (with ``--no-table``) or after the table: N rounds of a
small job (``--kill-ranks`` ranks x ``--kill-mib`` MiB, forked from one interpreter), SIGTERM on rank 1 at a
seeded random step, then a SIGKILL of every rank at a seeded random moment within ``--kill-grace`` seconds,
the server throttled from the notice; after each, every committed durable step must restore and verify on
every rank, and the newest durable step must not be older than before the signal (:func:`durability`).

Run: PYTHONPATH=src .venv/bin/python benchmarks/recovery.py [--quick] [--no-table --kills 200 --seed 0]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
WORLD = 3
BUCKET = "recovery-bench"


class ThrottledRelay:
    """A loopback TCP relay in front of ``upstream``: counts the bytes the server sends back, and with
    ``rate`` (bytes/s, shared by all connections, each direction) throttles the traffic."""

    def __init__(self, upstream: tuple[str, int]) -> None:
        self.upstream = upstream
        self.rate: float | None = None
        self.received = 0  # bytes from the server to the clients
        self._lock = threading.Lock()
        self._next = {"up": 0.0, "down": 0.0}
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.endpoint = f"http://127.0.0.1:{self._listener.getsockname()[1]}"
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            server = socket.create_connection(self.upstream)
            threading.Thread(target=self._pipe, args=(client, server, "up"), daemon=True).start()
            threading.Thread(target=self._pipe, args=(server, client, "down"), daemon=True).start()

    def _pipe(self, src: socket.socket, dst: socket.socket, way: str) -> None:
        try:
            while data := src.recv(65536):
                self._pace(way, len(data))
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def _pace(self, way: str, n: int) -> None:
        with self._lock:
            if way == "down":
                self.received += n
            rate = self.rate
            if not rate:
                return
            now = time.monotonic()
            start = max(now, self._next[way])
            self._next[way] = start + n / rate
        if start + n / rate > now:
            time.sleep(start + n / rate - now)

    def close(self) -> None:
        self._listener.close()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class ForkServer:
    """``recovery_worker.py --fork-server``: forks ranks (and the check) from one interpreter that imported
    torch and vertexrt once; :meth:`fork` gives a ``Popen``-like handle."""

    def __init__(self, env: dict[str, str]) -> None:
        worker = os.path.join(HERE, "recovery_worker.py")
        self.proc = subprocess.Popen(
            [sys.executable, worker, "--fork-server"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env
        )

    def ask(self, request: dict[str, Any]) -> Any:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps(request).encode() + b"\n")
        self.proc.stdin.flush()
        return json.loads(self.proc.stdout.readline())

    def fork(self, request: dict[str, Any]) -> Forked:
        return Forked(self, int(self.ask(request)))

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        self.proc.wait()


class Forked:
    """A process the fork server forked: ``poll``, ``wait`` and ``kill`` as ``subprocess.Popen`` has them."""

    def __init__(self, server: ForkServer, pid: int) -> None:
        self.server, self.pid = server, pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self.server.ask({"poll": self.pid})
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if timeout is None and self.returncode is None:
            self.returncode = self.server.ask({"wait": self.pid})
        deadline = time.monotonic() + (timeout or 0)
        while self.poll() is None:
            if time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"pid {self.pid}", timeout or 0)
            time.sleep(0.01)
        assert self.returncode is not None
        return self.returncode

    def kill(self) -> None:
        if self.returncode is None:
            os.kill(self.pid, signal.SIGKILL)


def launch(
    cfg: dict[str, Any], env: dict[str, str], *, wait: bool = True, server: ForkServer | None = None
) -> list[Any]:
    """The ranks of one launch (``cfg`` as ``recovery_worker.py`` takes it; ``world`` ranks, default 3):
    fresh processes, or forks of ``server``."""
    cfg = dict(cfg, launched_at=time.time())
    port, world = _free_port(), cfg.get("world", WORLD)
    if server is not None:
        procs: list[Any] = [
            server.fork(
                {
                    "rank": r,
                    "world": world,
                    "port": port,
                    "cfg": cfg,
                    "log": cfg["report"].format(rank=r) + ".log",
                }
            )
            for r in range(world)
        ]
        if wait:
            finish(procs, cfg)
        return procs
    procs = []
    for r in range(world):
        with open(cfg["report"].format(rank=r) + ".log", "w") as log:
            worker = [sys.executable, os.path.join(HERE, "recovery_worker.py"), str(r), str(world), str(port)]
            procs.append(
                subprocess.Popen([*worker, json.dumps(cfg)], stdout=subprocess.DEVNULL, stderr=log, env=env)
            )
    if wait:
        finish(procs, cfg)
    return procs


def finish(procs: list[Any], cfg: dict[str, Any], timeout: float = 600) -> None:
    victim = procs[1]
    if cfg.get("die_at", -1) >= 0:
        victim.wait(timeout=timeout)
        for p in procs:
            if p.poll() is None:
                p.kill()
    for r, p in enumerate(procs):
        code = p.wait(timeout=timeout)
        if code not in (0, 143, -9) and cfg.get("die_at", -1) < 0:  # with a VM lost, its peers fail
            with open(cfg["report"].format(rank=r) + ".log") as log:
                raise RuntimeError(f"rank {r} exited {code}:\n{log.read()[-3000:]}")


def reports(cfg: dict[str, Any]) -> dict[int, dict[str, Any]]:
    """The reports the ranks wrote (a rank killed from outside writes none)."""
    out = {}
    for r in range(cfg.get("world", WORLD)):
        path = cfg["report"].format(rank=r)
        if os.path.exists(path):
            with open(path) as f:
                out[r] = json.load(f)
    return out


@dataclass(frozen=True)
class Budget:
    """One durable-only run's blocking against the fast configuration's blocking budget."""

    fast_per_step: float  # seconds save() blocked per step, fast configuration (its durable saves included)
    durable_per_save: float  # seconds one durable save blocked, durable only, same state and storage
    every: int  # that durable-only run saved every ``every`` steps
    interval: int  # ceil(durable_per_save / fast_per_step): k' as this run measures it

    @property
    def within(self) -> bool:
        """Saving every ``every`` steps, this run blocked no more per step than the fast configuration."""
        return self.interval <= self.every

    def derivation(self) -> str:
        return (
            f"ceil({self.durable_per_save * 1e3:.1f} ms blocked per durable save (durable only, every "
            f"{self.every}) / {self.fast_per_step * 1e3:.2f} ms blocked per step (fast configuration)) = "
            f"{self.interval}"
        )


def same_budget(
    fast_blocked: Mapping[Any, float],
    durable_blocked: Mapping[Any, float],
    durable_steps: Iterable[int],
    every: int,
) -> Budget:
    """k' from the seconds ``save()`` blocked per step in a fast run (``fast_blocked``: step -> seconds)
    and in a durable-only run saving every ``every`` steps (``durable_blocked``, its saves at
    ``durable_steps``); step 0, which sets up the staging, is left out of both. Only the steps that saved
    count towards a durable save's cost (which includes waiting for the previous save still writing).

    Raises:
        ValueError: no durable save after step 0, or the fast run never blocked.
    """
    fast = [seconds for step, seconds in fast_blocked.items() if int(step) > 0]
    saved = {int(step) for step in durable_steps if int(step) > 0}
    saves = [seconds for step, seconds in durable_blocked.items() if int(step) in saved]
    if not saves:
        raise ValueError(
            f"no durable save after step 0 among steps {sorted(durable_steps)}: nothing to measure"
        )
    fast_per_step = sum(fast) / len(fast) if fast else 0.0
    if fast_per_step <= 0:
        raise ValueError("the fast run's save() never blocked: no budget to match")
    durable_per_save = sum(saves) / len(saves)
    return Budget(fast_per_step, durable_per_save, every, max(1, math.ceil(durable_per_save / fast_per_step)))


def next_every(measured: Sequence[Budget]) -> int | None:
    """The next durable-only interval to measure after ``measured``, or None when k' is found: the smallest
    interval measured within the budget, with the next shorter one over it (or none shorter than 2).

    A save's blocking grows when saves come faster than the writes finish (each waits for the previous one),
    so the k' one run derives is measured too: the next interval is the last run's k' when it lies between
    the longest interval over the budget and the shortest within it, else their midpoint.
    """
    over = max((m.every for m in measured if not m.within), default=0)
    within = min((m.every for m in measured if m.within), default=None)
    guess = measured[-1].interval
    if within is None:
        return max(guess, over + 1)
    if within - over <= 1 or within == 1:
        return None
    return (
        guess if over < guess < within and guess not in {m.every for m in measured} else (over + within) // 2
    )


def k_prime(measured: Sequence[Budget]) -> int:
    """The shortest interval measured within the budget; without one, the last run's k' (unchecked)."""
    within = [m.every for m in measured if m.within]
    return min(within) if within else measured[-1].interval


def per_step(rep: dict[str, Any]) -> float:
    """Mean seconds ``save()`` blocked per step (step 0, which sets up the staging, left out)."""
    blocked = [v for k, v in rep["blocked"].items() if int(k) > 0]
    return sum(blocked) / max(1, len(blocked))


class Bench:
    def __init__(self, args: argparse.Namespace, root: str, relay: ThrottledRelay) -> None:
        self.args, self.root, self.relay = args, root, relay
        self.env = dict(
            os.environ,
            STORAGE_EMULATOR_HOST=relay.endpoint,
            GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT="false",
            VERTEXRT_PREEMPTION_GRACE=str(args.grace),
        )
        self.runs = 0

    def config(self, fast_every: int, durable_every: int, **extra: Any) -> dict[str, Any]:
        self.runs += 1
        base = os.path.join(self.root, f"run{self.runs}")
        os.makedirs(base)
        cfg = {
            "durable": f"gs://{BUCKET}/run{self.runs}",
            "local_root": os.path.join(base, "local"),
            "total": self.args.die_at + 4,
            "durable_every": durable_every,
            "fast_every": fast_every,
            "mib": self.args.mib,
            "step_seconds": self.args.step_ms / 1000,
            "die_at": -1,
            "term_at": -1,
            "report": os.path.join(base, "rank{rank}.json"),
            "marker": os.path.join(base, "marker.json"),
        }
        cfg.update(extra)
        return cfg

    def restart(self, cfg: dict[str, Any], wipe: list[int]) -> dict[str, Any]:
        """Wipe the lost VMs' disks, relaunch to the end; the restart's numbers."""
        before = reports(cfg)
        last_done = max(max(map(int, r["blocked"]), default=-1) for r in before.values())
        for r in wipe:
            shutil.rmtree(os.path.join(cfg["local_root"], f"replica{r}"), ignore_errors=True)
        again = dict(cfg, die_at=-1, term_at=-1, report=cfg["report"].replace(".json", ".restart.json"))
        self.relay.received = 0
        launch(again, self.env)
        after = reports(again)
        resumed = after[0]["resumed"]
        return {
            "lost": last_done - (resumed if resumed is not None else -1),
            "resumed": resumed,
            "first_step_s": max(r["first_step_s"] for r in after.values()),
            "read_mb": self.relay.received / 1e6,
            "before": before,
        }

    def crash(self, fast_every: int, durable_every: int, wipe: list[int]) -> dict[str, Any]:
        cfg = self.config(fast_every, durable_every, die_at=self.args.die_at)
        launch(cfg, self.env)
        return self.restart(cfg, wipe)

    def preempt(self, fast_every: int, durable_every: int) -> dict[str, Any]:
        """SIGTERM on rank 1; every rank still running ``--grace`` seconds later is SIGKILLed (the VM is
        reclaimed), then the job restarts with rank 1's disk wiped."""
        cfg = self.config(fast_every, durable_every, term_at=self.args.die_at)
        try:
            procs = launch(cfg, self.env, wait=False)
            signalled = wait_marker(cfg, procs)
            self.relay.rate = self.args.throttle_mbs * 1e6  # the bandwidth drops with the notice
            for p in procs:
                p.wait(timeout=max(0.0, signalled + self.args.grace - time.time()) + 1e-3)
        except subprocess.TimeoutExpired:
            pass
        finally:
            self.relay.rate = None
            for p in procs:
                if p.poll() is None:
                    p.kill()
                p.wait()
        stopped = reports(cfg)
        result = self.restart(cfg, wipe=[1])
        done = [r for r in stopped.values() if "stop_s" in r]
        result["durable_saved"] = len(done) == WORLD and all(r["durable_saved"] for r in done)
        result["emergency_s"] = max(r["stop_s"] for r in done) - signalled if len(done) == WORLD else None
        return result

    def calibrate(self, fast_run: dict[str, Any], runs: int = 4) -> list[Budget]:
        """k' for ``fast_run`` (rank 1's report): durable-only runs of the same state on the same storage,
        first saving every ``--calibrate-every`` steps, then as :func:`next_every` says (at most ``runs``);
        :func:`k_prime` of them is k'."""
        measured: list[Budget] = []
        every: int | None = self.args.calibrate_every
        while every is not None and len(measured) < runs:
            cfg = self.config(0, every, total=self.args.die_at)
            launch(cfg, self.env)
            durable = reports(cfg)[1]
            measured.append(
                same_budget(fast_run["blocked"], durable["blocked"], durable["durable_steps"], every)
            )
            every = next_every(measured)
        return measured


def wait_marker(cfg: dict[str, Any], procs: list[Any]) -> float:
    """Wait for rank 1's SIGTERM marker; returns when it signalled."""
    while not os.path.exists(cfg["marker"]):
        if any(p.poll() is not None for p in procs):
            for p in procs:  # the others would wait for it in a collective
                if p.poll() is None:
                    p.kill()
            finish(procs, cfg)
            raise RuntimeError("a rank ended before the signal")
        time.sleep(0.01)
    with open(cfg["marker"]) as f:
        return float(json.load(f)["at"])


#: Where a hard kill landed, from the ranks' reports and the stopped step's files on the server.
KILL_MOMENTS = (
    "before the save",
    "during the write",
    "during the commit",
    "after the commit",
    "save declined",
)


def durability(bench: Bench, kills: int, *, ranks: int = 2, chain: int = 4) -> dict[str, Any]:
    """``kills`` rounds of SIGTERM at a random step, then SIGKILL of every rank at a random moment within
    the grace, the server throttled from the notice on. Rounds run in chains of ``chain`` launches on one
    durable directory (each launch resumes where the killed one left off, a new chain starts empty); round
    ``i`` draws from ``Random(f"{seed}:{i}")``, so ``--only i`` replays its chain alone.

    After each kill, every durable step the listing shows restores with its checksums on every rank's shard
    (the library's own restore: 0 partially visible steps) and the newest durable step is not older than
    the newest before the signal. Returns the counts; a round that breaks either is listed in ``failures``.
    """
    args, relay = bench.args, bench.relay
    window = min(args.kill_window or args.grace, args.grace)
    out: dict[str, Any] = {
        "kills": 0, "steps_verified": 0, "partial": 0, "regressions": 0, "durable_advanced": 0,
        "moments": dict.fromkeys(KILL_MOMENTS, 0), "failures": [],
    }  # fmt: skip
    only = getattr(args, "only", None)
    rounds = range(only - only % chain, only + 1) if only is not None else range(kills)
    cfg: dict[str, Any] = {}
    listed: dict[str, list[str]] = {}
    server = ForkServer(bench.env)
    try:
        for i in rounds:
            rng = random.Random(f"{args.seed}:{i}")
            if i % chain == 0:
                cfg = bench.config(args.fast_every, args.durable_every, total=10**6, world=ranks)
                listed = {}
            cfg = dict(cfg, term_after=rng.randint(1, 3 * args.durable_every), term_at=-1)
            cfg["report"] = os.path.join(os.path.dirname(cfg["marker"]), f"kill{i}.rank{{rank}}.json")
            if os.path.exists(cfg["marker"]):
                os.remove(cfg["marker"])
            procs = launch(cfg, bench.env, wait=False, server=server)
            try:
                signalled = wait_marker(cfg, procs)
            except RuntimeError as exc:  # a rank failed before the signal (e.g. its resume): a bug to report
                out["failures"].append(f"seed {args.seed} round {i}: {exc}")
                print(f"  round {i}: {exc}", flush=True)
                continue
            try:
                relay.rate = args.throttle_mbs * 1e6  # the bandwidth drops with the notice
                with open(cfg["marker"]) as f:
                    before = json.load(f)["durable"]
                killed = signalled + rng.uniform(0, window)
                time.sleep(max(0.0, killed - time.time()))
            finally:
                for p in procs:
                    p.kill()
                for p in procs:
                    p.wait()
                relay.rate = None
            problem, steps, files = verify_durable(cfg["durable"], bench.env, ranks, server)
            moment = kill_moment(reports(cfg), files, listed, ranks)
            listed = files
            newest = max(steps, default=None)
            if problem:
                out["partial"] += 1
            elif before is not None and (newest is None or newest < before):
                out["regressions"] += 1
                problem = f"newest durable step {newest} < {before}, the newest before the signal"
            if problem:
                out["failures"].append(f"seed {args.seed} round {i}: {problem}")
                print(f"  round {i}: {problem}", flush=True)
            out["kills"] += 1
            out["steps_verified"] += len(steps)
            out["durable_advanced"] += int(newest != before)
            out["moments"][moment] += 1
            if (i + 1) % 10 == 0:
                print(f"  {i + 1} kills: {out['moments']}", flush=True)
    finally:
        server.close()
    return out


def kill_moment(
    reps: dict[int, dict[str, Any]], files: dict[str, list[str]], before: dict[str, list[str]], ranks: int
) -> str:
    """Where the kill landed: no rank had begun its emergency save; a rank declined it (it would not fit
    in the grace); or, by the files this launch added to the stopped step, during the write of the data
    files and bodies, during the commit (every rank's body written, no manifest yet), or after it."""
    stopped = [r for r in reps.values() if "stopped" in r]
    if not stopped:
        return "before the save"
    if any(r.get("durable_saved") is False for r in stopped):
        return "save declined"
    step = f"step_{stopped[0]['stopped']:010d}"
    added = set(files.get(step, [])) - set(before.get(step, []))
    if "manifest.json" in files.get(step, []):
        return "after the commit"
    tokens: dict[str, int] = {}
    for name in added:
        if name.endswith(".body.json"):
            token = name.split(".")[1]
            tokens[token] = tokens.get(token, 0) + 1
    return "during the commit" if any(n == ranks for n in tokens.values()) else "during the write"


def verify_durable(
    durable: str, env: dict[str, str], world: int = WORLD, server: ForkServer | None = None
) -> tuple[str, list[int], dict]:
    """Restore every committed durable step on every rank's shard, in a fresh process (the library's own
    restore, which checks every file's size and CRC32C against the manifest); returns what went wrong
    (empty: nothing), the committed steps, and the files of every step directory."""
    code = (
        "import json,sys\n"
        "from vertexrt import paths\n"
        "from vertexrt.checkpoint import CheckpointManager\n"
        "d, w = sys.argv[1], int(sys.argv[2])\n"
        "mgr = CheckpointManager(d, rank=w - 1, world_size=w)  # rank 0 would clean leftovers up\n"
        "steps, problem = mgr.all_steps(), ''\n"
        "for s in steps:\n"
        "    for r in range(w):\n"
        "        try:\n"
        "            mgr.restore(step=s, shard=r)\n"
        "        except Exception as exc:\n"
        "            problem = problem or f'step {s} shard {r}: {type(exc).__name__}: {exc}'\n"
        "fs, root = paths.filesystem(d)\n"
        "name = lambda path: path.rstrip('/').rsplit('/', 1)[-1]\n"
        "found = fs.ls(root, detail=False, refresh=True) if fs.exists(root) else []\n"
        "files = {name(e): sorted(map(name, fs.ls(e, detail=False))) for e in found if fs.isdir(e)}\n"
        "print(json.dumps([problem, steps, files]))\n"
    )
    if server is None:
        run = subprocess.run(
            [sys.executable, "-c", code, durable, str(world)], env=env, capture_output=True, text=True
        )
        returncode, stdout, stderr = run.returncode, run.stdout, run.stderr
    else:
        scratch = tempfile.mkdtemp(prefix="verify-")
        out, log = os.path.join(scratch, "out"), os.path.join(scratch, "log")
        returncode = server.fork({"code": code, "args": [durable, str(world)], "out": out, "log": log}).wait()
        with open(out) as f, open(log) as g:
            stdout, stderr = f.read(), g.read()
        shutil.rmtree(scratch)
    if returncode != 0:
        return f"the check failed:\n{stderr[-3000:]}", [], {}
    problem, steps, files = json.loads(stdout.strip().splitlines()[-1])
    return problem, steps, files


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small state, fewer steps")
    parser.add_argument("--mib", type=int, default=16, help="state per rank (MiB)")
    parser.add_argument("--step-ms", type=float, default=100.0)
    parser.add_argument("--fast-every", type=int, default=5)
    parser.add_argument("--durable-every", type=int, default=40)
    parser.add_argument("--die-at", type=int, default=48)
    parser.add_argument("--calibrate-every", type=int, default=10, help="durable saves timed for k'")
    parser.add_argument("--grace", type=float, default=30.0)
    parser.add_argument("--throttle-mbs", type=float, default=1.0, help="server MB/s while throttled")
    parser.add_argument("--kills", type=int, default=0, help="rounds of the durability check")
    parser.add_argument("--kill-ranks", type=int, default=2, help="ranks per launch in the durability check")
    parser.add_argument("--kill-mib", type=int, default=1, help="state per rank in the durability check")
    parser.add_argument("--kill-grace", type=float, default=4.0, help="grace (s) in the durability check")
    parser.add_argument("--kill-window", type=float, default=None, help="kill within (s; default: the grace)")
    parser.add_argument("--only", type=int, default=None, help="replay this round (and its chain) alone")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-table", action="store_true", help="only the durability check")
    args = parser.parse_args()
    if args.quick:
        args.mib, args.die_at, args.durable_every, args.throttle_mbs = 4, 28, 20, 0.2

    from vertexrt.emulator import GCSServer

    root = tempfile.mkdtemp(prefix="vertexrt-recovery-bench-")
    server = GCSServer(buckets=[BUCKET], log_path=os.path.join(root, "gcs.log")).start()
    relay = ThrottledRelay(("127.0.0.1", server.port))
    try:
        bench = Bench(args, root, relay)
        if not args.no_table:
            table(bench, args)
        if args.kills or args.only is not None:
            kills(args, root, relay)
    finally:
        relay.close()
        server.stop()
        shutil.rmtree(root, ignore_errors=True)


def kills(args: argparse.Namespace, root: str, relay: ThrottledRelay) -> None:
    """The durability check with its own small job: ``--kill-ranks`` ranks (the commit gathers every rank's
    shard), ``--kill-mib`` MiB per rank (at ``--throttle-mbs`` the emergency save takes a good part of the
    ``--kill-grace``, so the kills land before, during and after it), 20 ms steps, fast every 2, durable
    every 4; then the summary."""
    if args.kill_ranks < 2:
        raise SystemExit("--kill-ranks: at least 2 (rank 1 takes the signal; rank 0 commits)")
    small = argparse.Namespace(
        **dict(
            vars(args), mib=args.kill_mib, grace=args.kill_grace, step_ms=20.0, fast_every=2, durable_every=4
        )
    )
    began = time.monotonic()
    out = durability(Bench(small, os.path.join(root, "kills"), relay), args.kills, ranks=args.kill_ranks)
    print(
        f"durability: {out['kills']} hard kills (seed {args.seed}), {args.kill_ranks} ranks x "
        f"{args.kill_mib} MiB, SIGTERM at a random step, SIGKILL of every rank within "
        f"{min(small.kill_window or small.grace, small.grace):.1f} s of it, grace {small.grace:.0f} s, "
        f"server at {args.throttle_mbs} MB/s from the notice; {time.monotonic() - began:.0f} s"
    )
    print("kill moments: " + ", ".join(f"{k} {v}" for k, v in out["moments"].items()))
    print(
        f"partially visible steps {out['partial']}, durable step regressions {out['regressions']}, "
        f"steps verified {out['steps_verified']}, kills after which the durable step advanced "
        f"{out['durable_advanced']}, failures {len(out['failures'])}"
    )
    for failure in out["failures"]:
        print("  " + failure)


def table(bench: Bench, args: argparse.Namespace) -> None:
    one = bench.crash(args.fast_every, args.durable_every, wipe=[1])
    fast_per_step = per_step(one["before"][1])
    measured = bench.calibrate(one["before"][1])
    k = k_prime(measured)
    rows = [("one VM lost", "fast", one, fast_per_step)]
    base = bench.crash(0, k, wipe=[1])
    rows.append(("one VM lost", f"durable/{k}", base, per_step(base["before"][1])))
    two = bench.crash(args.fast_every, args.durable_every, wipe=[1, 2])
    rows.append(("two VMs, one group", "fast", two, per_step(two["before"][1])))
    term = bench.preempt(args.fast_every, args.durable_every)
    rows.append((f"SIGTERM {args.grace:.0f}s grace", "fast", term, per_step(term["before"][1])))
    term_base = bench.preempt(0, k)
    rows.append(
        (f"SIGTERM {args.grace:.0f}s grace", f"durable/{k}", term_base, per_step(term_base["before"][1]))
    )
    step_s = args.step_ms / 1000
    print(
        f"{WORLD} gloo CPU ranks, {args.mib} MiB per rank, {args.step_ms:.0f} ms steps, fast every "
        f"{args.fast_every} + durable every {args.durable_every} vs durable-only every {k} (same blocking); "
        f"failure after step {args.die_at}; SIGTERM rows: server at {args.throttle_mbs} MB/s"
    )
    for budget in measured:
        verdict = "within the budget" if budget.within else "over the budget"
        print(f"same blocking budget: {budget.derivation()}; saving every {budget.every}: {verdict}")
    print(f"k' = {k}")
    head = ("scenario", "tiers", "lost", "resumed", "first step s", "GCS MB read", "blocked/step", "note")
    print("{:<22}{:<13}{:>6}{:>9}{:>14}{:>13}{:>14}  {}".format(*head))
    for name, tiers, r, blocked in rows:
        note = ""
        if "durable_saved" in r:
            took = "cut by the grace" if r["emergency_s"] is None else f"{r['emergency_s']:.1f} s"
            note = f"emergency save {took}, durable step {'made' if r['durable_saved'] else 'not made'}"
        share = f"{blocked / step_s:.1%}" if blocked else "-"
        print(
            f"{name:<22}{tiers:<13}{r['lost']:>6}{str(r['resumed']):>9}{r['first_step_s']:>14.1f}"
            f"{r['read_mb']:>13.1f}{share:>14}  {note}"
        )


if __name__ == "__main__":
    main()

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
and durable every ``--durable-every`` steps; the baseline saves durable only, every k' steps: k' is the
blocking of one durable save (a durable-only calibration run saving every ``--fast-every`` steps) over the
fast configuration's blocking per step. The table shows both blockings as measured.

``--kills N`` adds the durability check: N times, SIGTERM on rank 1 and then a SIGKILL of every rank at a
random (seeded) moment during the emergency save, with the server throttled; after each, every committed
durable step must restore and verify on every rank, and the newest durable step must not be older than
before the signal.

Run: PYTHONPATH=src .venv/bin/python benchmarks/recovery.py [--quick] [--kills 200]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
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


def launch(cfg: dict[str, Any], env: dict[str, str], *, wait: bool = True) -> list[subprocess.Popen[bytes]]:
    """The three ranks of one launch (``cfg`` as ``recovery_worker.py`` takes it)."""
    cfg = dict(cfg, launched_at=time.time())
    port = _free_port()
    procs = []
    for r in range(WORLD):
        with open(cfg["report"].format(rank=r) + ".log", "w") as log:
            worker = [sys.executable, os.path.join(HERE, "recovery_worker.py"), str(r), str(WORLD), str(port)]
            procs.append(
                subprocess.Popen([*worker, json.dumps(cfg)], stdout=subprocess.DEVNULL, stderr=log, env=env)
            )
    if wait:
        finish(procs, cfg)
    return procs


def finish(procs: list[subprocess.Popen[bytes]], cfg: dict[str, Any], timeout: float = 600) -> None:
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
    for r in range(WORLD):
        path = cfg["report"].format(rank=r)
        if os.path.exists(path):
            with open(path) as f:
                out[r] = json.load(f)
    return out


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

    def calibrate(self) -> float:
        """Seconds a durable save blocks ``save()`` (durable only, a save every ``--fast-every`` steps)."""
        cfg = self.config(0, self.args.fast_every, total=self.args.die_at)
        launch(cfg, self.env)
        return per_step(reports(cfg)[1]) * self.args.fast_every


def wait_marker(cfg: dict[str, Any], procs: list[subprocess.Popen[bytes]]) -> float:
    """Wait for rank 1's SIGTERM marker; returns when it signalled."""
    while not os.path.exists(cfg["marker"]):
        if any(p.poll() is not None for p in procs):
            finish(procs, cfg)
            raise RuntimeError("a rank ended before the signal")
        time.sleep(0.01)
    with open(cfg["marker"]) as f:
        return float(json.load(f)["at"])


def durability(bench: Bench, kills: int) -> dict[str, int]:
    """N SIGTERM-then-SIGKILL rounds on one run; returns the counts checked (raises on a violation)."""
    args, relay = bench.args, bench.relay
    rng = random.Random(args.seed)
    cfg = bench.config(args.fast_every, args.fast_every, total=10**6)
    checked = {"kills": 0, "steps_verified": 0, "durable_advanced": 0}
    step = 0
    for _ in range(kills):
        step += args.fast_every + 1
        cfg = dict(cfg, term_at=step, total=step + 2)
        if os.path.exists(cfg["marker"]):
            os.remove(cfg["marker"])
        relay.rate = args.throttle_mbs * 1e6
        procs = launch(cfg, bench.env, wait=False)
        try:
            wait_marker(cfg, procs)
            with open(cfg["marker"]) as f:
                before = json.load(f)["durable"]
            time.sleep(rng.uniform(0, args.kill_window))
        finally:
            for p in procs:
                p.kill()
            for p in procs:
                p.wait()
            relay.rate = None
        steps = verify_durable(cfg["durable"], bench.env)
        newest = max(steps, default=None)
        if before is not None and (newest is None or newest < before):
            raise AssertionError(f"kill {checked['kills']}: newest durable step {newest} < {before}")
        checked["kills"] += 1
        checked["steps_verified"] += len(steps)
        checked["durable_advanced"] += int(newest != before)
        step = max(step, (newest or 0) + 1)  # the next round's signal comes after the resumed step
    return checked


def verify_durable(durable: str, env: dict[str, str]) -> list[int]:
    """Every committed durable step restores and verifies on every rank's shard; returns the steps."""
    code = (
        "import json,sys\n"
        "from vertexrt.checkpoint import CheckpointManager\n"
        "d, w = sys.argv[1], int(sys.argv[2])\n"
        "mgr = CheckpointManager(d, rank=w - 1, world_size=w)  # rank 0 would clean leftovers up\n"
        "steps = mgr.all_steps()\n"
        "for s in steps:\n"
        "    for r in range(w):\n"
        "        mgr.restore(step=s, shard=r)\n"
        "print(json.dumps(steps))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, durable, str(WORLD)], env=env, capture_output=True, text=True
    )
    if out.returncode != 0:
        raise AssertionError(f"a committed durable step does not restore:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small state, fewer steps")
    parser.add_argument("--mib", type=int, default=16, help="state per rank (MiB)")
    parser.add_argument("--step-ms", type=float, default=100.0)
    parser.add_argument("--fast-every", type=int, default=5)
    parser.add_argument("--durable-every", type=int, default=40)
    parser.add_argument("--die-at", type=int, default=48)
    parser.add_argument("--grace", type=float, default=30.0)
    parser.add_argument("--throttle-mbs", type=float, default=1.0, help="server MB/s while throttled")
    parser.add_argument("--kills", type=int, default=0)
    parser.add_argument("--kill-window", type=float, default=3.0, help="seconds after the signal")
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
        if args.kills:
            print(f"durability: {durability(bench, args.kills)} (0 partially visible steps)")
    finally:
        relay.close()
        server.stop()
        shutil.rmtree(root, ignore_errors=True)


def table(bench: Bench, args: argparse.Namespace) -> None:
    one = bench.crash(args.fast_every, args.durable_every, wipe=[1])
    fast_per_step = per_step(one["before"][1])
    k = max(1, math.ceil(bench.calibrate() / max(fast_per_step, 1e-9)))
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

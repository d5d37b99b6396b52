"""benchmarks/scale.py --quick: the tables' shape, and request counts that are positive and the same twice.

One run of the script (its two gloo processes are the slow part) holds the repeats: the simulation runs
twice at N=1 and N=2, and the real ranks run the same code at the same N. Timings are never asserted.
Compared: reads, writes, deletes and listings. Left out, each for a named cause: metadata GETs and gcsfs's
1-result "probe" lists (``info()`` sends both at once and cancels the probe when the GET answers, so
whether it reaches the server is a race; with the simulation's 1 ms per request gcsfs also sends fewer
of both), and the sharded save's counts with several ranks (today's commit polls storage: rank 0 lists
the write directory until every shard record arrived; issue 22, item 2 removes the polling).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
from jobs import run_job

ROOT = Path(__file__).resolve().parents[1]
OPERATIONS = ("save", "restore", "count")
KINDS = ("list", "metadata", "read", "write", "delete")
STABLE = ("read", "write", "delete")


def _quick(tmp_path: Path) -> tuple[str, dict]:
    out = tmp_path / "scale.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    script = str(ROOT / "benchmarks" / "scale.py")
    command = [sys.executable, script, "--quick", "--sim", "1,2,1,2", "--json", str(out)]
    result = run_job(command, cwd=ROOT, timeout=540, env=env)
    assert result.returncode == 0, result.stdout[-5000:]
    return result.stdout, json.loads(out.read_text())


def _counts(row: dict) -> dict:
    """The counts that do not depend on timing (see the module's docstring)."""
    return {
        op: {"listings": row["ops"][op]["list"] - row["ops"][op]["probes"]}
        | {kind: row["ops"][op][kind] for kind in STABLE}
        for op in OPERATIONS
        if not (op == "save" and row["n"] > 1)
    }


@pytest.mark.slow
@pytest.mark.timeout(600)  # two torch processes and a GCS server on a shared 2-core machine
def test_quick_tables_have_their_shape_and_counts_repeat(tmp_path: Path) -> None:
    out, result = _quick(tmp_path)
    rows = result["rows"]

    for title in ("sharded save + commit", "restore of the newest step", "equalize counting", "stop vote"):
        assert f"## {title}" in out
    shape = [(row["mode"], row["n"]) for row in rows]
    assert shape == [("real", 1), ("real", 2), ("sim", 1), ("sim", 2), ("sim", 1), ("sim", 2)]
    for row in rows:
        assert row["untagged"] == 0, row  # every request is attributed to a rank and an operation
        for op in OPERATIONS:
            stats = row["ops"][op]
            assert stats["requests"] == sum(stats[kind] for kind in KINDS) > 0, (row["mode"], row["n"], op)
            assert stats["per_rank_max"] > 0 and stats["bytes_mean"] > 0
        assert row["ops"]["count"]["read"] >= 1
    assert result["vote"]["measured_ms"]  # the all-reduce timed on the real ranks (its value is not asserted)

    real_1, real_2, sim_1, sim_2, sim_1_again, sim_2_again = (_counts(row) for row in rows)
    assert (sim_1_again, sim_2_again) == (sim_1, sim_2)
    # the simulation runs the same code as the real ranks: the same requests at the same N
    assert sim_1 == real_1
    assert sim_2 == real_2

"""Per-call cost of a hypertune report: cloudml-hypertune vs vertexrt.hypertune.report.

Both rewrite the whole metric file (up to 100 entries) on every call; vertexrt also checks the value,
asks who the chief is and replaces the file atomically. Run: `.venv/bin/python benchmarks/hypertune.py`.
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
import time

# This file is named hypertune.py: keep `import hypertune` from finding it instead of cloudml-hypertune.
sys.path = [p for p in sys.path if os.path.abspath(p or ".") != os.path.dirname(os.path.abspath(__file__))]

CALLS = 2000
RUNS = 5


def _cloudml(path: str) -> float:
    import hypertune

    os.environ["CLOUD_ML_HP_METRIC_FILE"] = path
    reporter = hypertune.HyperTune()
    start = time.perf_counter()
    for i in range(CALLS):
        reporter.report_hyperparameter_tuning_metric("accuracy", i / CALLS, global_step=i)
    return (time.perf_counter() - start) / CALLS


def _vertexrt(path: str) -> float:
    from vertexrt import hypertune

    os.environ["CLOUD_ML_HP_METRIC_FILE"] = path
    start = time.perf_counter()
    for i in range(CALLS):
        hypertune.report("accuracy", i / CALLS, step=i)
    return (time.perf_counter() - start) / CALLS


def main() -> None:
    results: dict[str, list[float]] = {"cloudml-hypertune": [], "vertexrt.hypertune": []}
    with tempfile.TemporaryDirectory() as tmp:
        for run in range(RUNS):
            results["cloudml-hypertune"].append(_cloudml(os.path.join(tmp, f"c{run}", "output.metrics")))
            results["vertexrt.hypertune"].append(_vertexrt(os.path.join(tmp, f"v{run}", "output.metrics")))
    base = statistics.median(results["cloudml-hypertune"])
    print(f"hypertune report, {CALLS} calls per run (file holds the last 100), median of {RUNS} runs")
    print(f"{'implementation':<22} {'us/call':>10} {'ratio':>8}")
    for name, times in results.items():
        median = statistics.median(times)
        print(f"{name:<22} {median * 1e6:>10.1f} {median / base:>7.2f}x")


if __name__ == "__main__":
    main()

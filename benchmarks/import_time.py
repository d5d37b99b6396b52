"""How much `import vertexrt` adds to a fresh Python process (target: <= 20 ms over bare Python).

Median wall time over fresh processes of each snippet, minus the median of `python -c "pass"`.
Run: python benchmarks/import_time.py [--runs 30]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time

SNIPPETS = {
    "python -c pass (baseline)": "pass",
    "import vertexrt": "import vertexrt",
    "import vertexrt; vertexrt.environment()": "import vertexrt; vertexrt.environment()",
    "import gcsfs (what eager imports would cost)": "import gcsfs",
}


def median_ms(code: str, runs: int) -> float:
    samples = []
    for _ in range(runs):
        start = time.perf_counter()
        subprocess.run([sys.executable, "-c", code], check=True)
        samples.append((time.perf_counter() - start) * 1000)
    return statistics.median(samples)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=30)
    runs = parser.parse_args().runs
    results = {name: median_ms(code, runs) for name, code in SNIPPETS.items()}
    base = results["python -c pass (baseline)"]
    print(f"median of {runs} fresh processes each")
    print(f"{'snippet':<46} {'ms':>8} {'over bare python':>17}")
    for name, ms in results.items():
        print(f"{name:<46} {ms:8.1f} {ms - base:+16.1f}")


if __name__ == "__main__":
    main()

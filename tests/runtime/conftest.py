"""Fixtures for the runtime tests: a clean local environment and a small JSONL training set."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

FEATURES = 3


@pytest.fixture
def runtime_env(clean_env: None, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """No Vertex variables, outputs under tmp_path, hypertune metrics in tmp_path/hp.metrics."""
    metrics = tmp_path / "hp.metrics"
    monkeypatch.setenv("CLOUD_ML_HP_METRIC_FILE", str(metrics))
    return metrics


@pytest.fixture
def regression_data(tmp_path: Path) -> str:
    """40 records ``{"id", "x": [3 floats], "y"}`` in two JSONL shards; returns their glob."""
    rng = random.Random(5)
    root = tmp_path / "data"
    root.mkdir()
    for shard in range(2):
        lines = []
        for i in range(shard, 40, 2):
            x = [round(rng.uniform(-1, 1), 3) for _ in range(FEATURES)]
            lines.append(json.dumps({"id": i, "x": x, "y": round(2 * x[0] - x[1] + 0.5, 3)}))
        (root / f"train-{shard}.jsonl").write_text("\n".join(lines) + "\n")
    return str(root / "train-*.jsonl")

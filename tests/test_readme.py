"""Every ```python block of README.md runs as written: each in a fresh ``python`` process, in an empty
temporary directory (its working directory), off Vertex, ``__name__ == "__main__"``.

What a block finds there, as on a user's machine pointed at a local Cloud Storage server:

- ``STORAGE_EMULATOR_HOST``: the test GCS server, with bucket ``my-bucket`` holding
  ``data/train-0.jsonl`` and ``data/train-1.jsonl`` (64 records ``{"x": [4 floats], "y": 0, 1 or 2}``);
- ``AIP_TRAINING_DATA_URI`` and ``AIP_VALIDATION_DATA_URI``: ``gs://my-bucket/data/train-*.jsonl`` (a managed
  dataset, as Vertex sets them);
- ``CLOUD_ML_HP_METRIC_FILE`` in the temporary directory; no Vertex variable, no cluster variable.

Blocks are found by their fence, so a new block is covered without touching this file.
"""

from __future__ import annotations

import json
import os
import random
import re
import sys
from pathlib import Path

import pytest
from jobs import run_job

README = Path(__file__).resolve().parents[1] / "README.md"
BUCKET = "my-bucket"
DATA_URI = f"gs://{BUCKET}/data/train-*.jsonl"


def python_blocks(text: str) -> list[tuple[str, str]]:
    """``(id, code)`` of each ```python block: the id is the nearest heading above it and its line."""
    blocks, heading = [], "top"
    lines = text.splitlines()
    index = 0
    while index < len(lines):
        line = lines[index]
        if line.startswith("#"):
            heading = re.sub(r"[^a-z0-9]+", "-", line.lstrip("#").strip().lower()).strip("-")
        if line.strip() == "```python":
            end = next(i for i in range(index + 1, len(lines)) if lines[i].strip() == "```")
            blocks.append((f"{heading}-L{index + 1}", "\n".join(lines[index + 1 : end]) + "\n"))
            index = end
        index += 1
    return blocks


BLOCKS = python_blocks(README.read_text())


def test_the_readme_has_python_blocks_and_each_is_found() -> None:
    assert len(BLOCKS) == README.read_text().count("```python") >= 10


@pytest.fixture(scope="module")
def readme_data(gcs_server: object) -> str:
    from vertexrt import paths

    fs, _ = paths.filesystem(f"gs://{BUCKET}/")
    if not fs.exists(BUCKET):
        fs.mkdir(BUCKET)
    rng = random.Random(0)
    for shard in range(2):
        lines = []
        for _ in range(32):
            x = [round(rng.uniform(-1, 1), 3) for _ in range(4)]
            lines.append(json.dumps({"x": x, "y": int(x[0] > 0) + int(x[1] > 0)}))
        with paths.open(f"gs://{BUCKET}/data/train-{shard}.jsonl", "w") as f:
            f.write("\n".join(lines) + "\n")
    return DATA_URI


@pytest.mark.slow
@pytest.mark.parametrize("code", [code for _, code in BLOCKS], ids=[name for name, _ in BLOCKS])
def test_readme_block_runs_as_written(code: str, readme_data: str, tmp_path: Path) -> None:
    script = tmp_path / "snippet.py"
    script.write_text(code)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AIP_", "CLOUD_ML_", "VERTEXRT_"))}
    for name in (
        "CLUSTER_SPEC",
        "TF_CONFIG",
        "RANK",
        "WORLD_SIZE",
        "LOCAL_RANK",
        "MASTER_ADDR",
        "MASTER_PORT",
    ):
        env.pop(name, None)
    env.update(
        AIP_TRAINING_DATA_URI=readme_data,
        AIP_VALIDATION_DATA_URI=readme_data,
        CLOUD_ML_HP_METRIC_FILE=str(tmp_path / "hypertune" / "output.metrics"),
        TF_CPP_MIN_LOG_LEVEL="2",
    )
    proc = run_job([sys.executable, str(script)], tmp_path, 180, env)
    assert proc.returncode == 0, f"{code}\n--- output ---\n{proc.stdout[-4000:]}"

"""Every integration says where it resumes in the same words: "resuming from <dir> (step N)"."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest

from vertexrt.checkpoint import CheckpointManager
from vertexrt.runtime import Context, main


def _resumed(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith("resuming from ")]


def test_main_and_ctx_checkpoints_restore_log_the_step_they_resume(
    runtime_env: Any, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    directory = str(tmp_path / "ckpt")

    @main
    def train(ctx: Context) -> Any:
        ctx.checkpoints = CheckpointManager(directory)
        return ctx.checkpoints.restore()  # the newest step: what a script under @main resumes from

    with CheckpointManager(directory) as manager:
        manager.save(7, {"w": 1.0}, force=True)
    caplog.set_level(logging.INFO)
    assert train([]) == {"w": 1.0}
    assert _resumed(caplog) == [f"resuming from {directory} (step 7)"]
    caplog.clear()
    with CheckpointManager(directory) as manager:
        manager.restore(step=7)  # a step named by the caller (Trainer, Lightning) is theirs to log
    assert _resumed(caplog) == []


def test_lightning_checkpoint_io_logs_the_step_it_resumes(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    pytest.importorskip("lightning")
    from vertexrt.integrations.lightning import VertexCheckpointIO

    directory = str(tmp_path / "ckpt")
    with CheckpointManager(directory) as manager:
        manager.save(12, {"lightning": {"global_step": 12}, "name": "last.ckpt"}, force=True)
    caplog.set_level(logging.INFO)
    assert (
        VertexCheckpointIO(directory).latest_path() == f"{directory}/step_12"
    )  # for Trainer.fit(ckpt_path=)
    assert _resumed(caplog) == [f"resuming from {directory} (step 12)"]


def test_hugging_face_callback_logs_the_step_it_resumes(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    pytest.importorskip("transformers")
    from vertexrt.integrations.huggingface import MARKER, VertexTrainerCallback

    output = tmp_path / "out"
    (output / "checkpoint-20").mkdir(parents=True)
    (output / "checkpoint-20" / MARKER).write_text(json.dumps({"step": 20}))
    caplog.set_level(logging.INFO)
    assert VertexTrainerCallback(str(output)).resume_from_checkpoint() == str(output / "checkpoint-20")
    assert _resumed(caplog) == [f"resuming from {output / 'checkpoint-20'} (step 20)"]

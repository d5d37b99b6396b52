"""What the Trainer checkpoints besides modules, and agreeing across ranks on the step to restore.

``LoopState`` is where the loop is; ``LoopAndAttributes`` saves it with the trainer's plain (JSON-able)
attributes, read at save time; ``is_per_rank`` sorts tracked state into what each rank has its own of and
what every rank has a copy of. ``restore_newest`` has every rank try the same step, newest first, and move on
together when some rank finds it damaged.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Container, Mapping
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from vertexrt.errors import CheckpointCorruptError, CheckpointError, DataError
from vertexrt.runtime.state import GeneratorState, is_json_value

logger = logging.getLogger(__name__)


@dataclass
class LoopState:
    """Where the loop is; saved with every checkpoint under ``"_loop"``."""

    step: int = 0
    epoch: int = 0
    batch_in_epoch: int = 0
    last_eval_step: int = -1
    eval_pending: bool = False
    eval_metrics: dict[str, float] = field(default_factory=dict)

    def state_dict(self) -> dict[str, Any]:
        return asdict(self)

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        for f in fields(self):
            if f.name in state:
                setattr(self, f.name, state[f.name])


class LoopAndAttributes:
    """The loop position plus ``owner``'s plain attributes (``attributes()``, read at save time)."""

    def __init__(self, loop: LoopState, attributes: Callable[[], dict[str, Any]], owner: object) -> None:
        self.loop, self.attributes, self.owner = loop, attributes, owner

    def state_dict(self) -> dict[str, Any]:
        return {**self.loop.state_dict(), "attributes": self.attributes()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.loop.load_state_dict(state)
        for name, value in (state.get("attributes") or {}).items():
            setattr(self.owner, name, value)


def plain_attributes(
    owner: object, *, config: Container[str], tracked: Container[str], skip: Container[str]
) -> dict[str, Any]:
    """``owner``'s JSON-able public attributes, except configuration (``config``: those set before
    ``fit()``) unless named in ``tracked``, and the names in ``skip``."""
    values = {}
    for name, value in vars(owner).items():
        if name.startswith("_") or name in skip:
            continue
        if (name not in config or name in tracked) and is_json_value(value):
            values[name] = value
    return values


def is_per_rank(value: Any) -> bool:
    """Generators and data (iterables that are not modules) differ per rank; the rest is replicated."""
    if isinstance(value, GeneratorState):
        return True
    return hasattr(value, "__iter__") and not hasattr(value, "parameters")


def _restore_failure(step: int, directory: str, error: Exception | None) -> Exception:
    """What stops fit() when ``step`` failed to restore on some rank for a reason other than damage."""
    data_error = error
    while data_error is not None and not isinstance(data_error, DataError):
        data_error = data_error.__cause__  # type: ignore[assignment]
    if data_error is not None:  # a reader's saved position does not fit the data as opened now
        return DataError(
            f"checkpoint step {step} in {directory} holds a read position the data as opened now cannot "
            f"take: {data_error}. fit() restores every reader's position with the weights: open the data "
            "as when that checkpoint was saved, or start the run fresh with an empty checkpoint directory "
            f"(a new AIP_CHECKPOINT_DIR; off Vertex a new VERTEXRT_LOCAL_DIR, or delete {directory})"
        )
    return CheckpointError(
        f"restoring checkpoint step {step} from {directory} failed"
        + (f": {error}" if error else " on another rank (its log says why)")
        + "; fix the cause (storage access, permissions) and restart the job"
    )


_RESTORED, _DAMAGED, _FAILED = 0, 1, 2  # a restore attempt, ordered so that the worst rank's wins


def _outcome(error: Exception | None) -> int:
    if error is None:
        return _RESTORED
    return _DAMAGED if isinstance(error, CheckpointCorruptError) else _FAILED


def restore_newest(manager: Any, load_step: Callable[[int], Exception | None], *, rank: int) -> bool:
    """Load the newest step of ``manager`` that every rank can load (``load_step(step)`` returns the error
    instead of raising, so every rank reaches the agreement); False when there is none.

    Raises:
        CheckpointError / DataError: a step failed on some rank for a reason other than damage (falling
            back to an older step would lose progress).
    """
    from vertexrt.distributed.collectives import all_max, broadcast, torch_dist

    dist = torch_dist()
    newest_first = broadcast(manager.all_steps()[::-1] if rank == 0 else None, dist)
    for step in newest_first:  # every rank tries the same step; all move on if any rank fails it
        error = load_step(step)
        [worst] = all_max([_outcome(error)], dist)
        if worst == _RESTORED:
            return True
        if worst == _FAILED:
            raise _restore_failure(step, manager.directory, error) from error
        logger.warning("checkpoint step %d is unusable on some rank: trying the previous one", step)
    what = "no usable checkpoint" if newest_first else "no checkpoint"
    logger.info("%s in %s: starting from step 0", what, manager.directory)
    return False


def restore_fast(manager: Any, load: Callable[[], bool]) -> bool:
    """Load the fast tier's newest step every rank can get (``load()``: False when none is newer than the
    durable tier's newest); the ranks agree on the outcome, so an error stops every rank.

    Raises:
        CheckpointError / DataError: the fast step failed to load on some rank.
    """
    from vertexrt.distributed.collectives import all_max, torch_dist

    restored, error = False, None
    try:
        restored = load()
    except Exception as err:
        logger.error("restoring the fast checkpoint step failed: %s: %s", type(err).__name__, err)
        error = err
    [failed] = all_max([int(error is not None)], torch_dist())
    if failed:
        step = manager.restored_step
        if step is None:
            raise CheckpointError(
                f"restoring from the fast checkpoint tier in {manager.fast_directory} failed"
                + (f": {error}" if error else " on another rank (its log says why)")
                + "; fix the cause (local disk, the process group) and restart the job"
            ) from error
        raise _restore_failure(step, manager.fast_directory, error) from error
    return restored

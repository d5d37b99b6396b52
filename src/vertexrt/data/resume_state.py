"""A dataset's resume state: its fields checked on load, the options that give its positions meaning
(and its fingerprint), and the merge of every rank's state for a resume on another world size.

A state is small JSON: ``version``, ``epoch``, ``fingerprint``, ``options``, ``readers``, ``world_size``,
``elastic``, ``plan`` (an elastic epoch's unread record intervals), ``covers`` (the readers whose positions
it holds), ``cursors`` (one per reader, with its data-audit tally when auditing) and, for a table, its read
``session``.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from typing import Any

from vertexrt.data.cursor import DONE, MAX_COUNT, Cursor, check_count, state_problem
from vertexrt.data.digest import Tally
from vertexrt.errors import DataError

STATE_VERSION = 1


def merge_states(states: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One data state from the states of every rank (each holds its own readers' positions), to resume
    on another world size.

    A rank that already finished the epoch (its state is at the next epoch) counts as done.

    Example:
        >>> everyone = [None] * world_size
        >>> torch.distributed.all_gather_object(everyone, loader.state_dict())
        >>> state = merge_states(everyone)     # save it; load it with any world size
    """
    if not states:
        raise DataError("merge_states([]): pass the data state of every rank")
    for state in states:  # each checked as load_state_dict checks it: a damaged one is named, not merged
        if not isinstance(state, dict) or state.get("version") != STATE_VERSION:
            raise DataError(
                f"merge_states: not a vertexrt data state (version {STATE_VERSION}): {str(state)[:200]}"
            )
        checked_state(state)
    epoch = min(int(s["epoch"]) for s in states)
    merged: dict[str, Any] = {**states[0], "epoch": epoch, "cursors": {}, "covers": []}
    covers: set[int] = set()
    for state in states:
        if state.get("fingerprint") != merged.get("fingerprint"):
            raise DataError(
                "merge_states: the states belong to different data or options (fingerprints "
                f"{merged.get('fingerprint')} and {state.get('fingerprint')}): merge one dataset's states"
            )
        readers = state.get("readers")
        if readers is not None and merged.get("readers") not in (None, readers):
            raise DataError(f"merge_states: states saved with {merged['readers']} and {readers} readers")
        for key in ("readers", "world_size", "plan"):
            if merged.get(key) is None:
                merged[key] = state.get(key)
        covers.update(int(r) for r in state.get("covers", state["cursors"]))
        if int(state["epoch"]) == epoch:
            merged["cursors"].update(state["cursors"])
        elif int(state["epoch"]) == epoch + 1:  # this rank finished the epoch
            for reader in state.get("covers", []):
                merged["cursors"][str(reader)] = Cursor(phase=DONE).to_dict()
        else:
            raise DataError(f"merge_states: states of epochs {epoch} and {state['epoch']} cannot be merged")
    merged["covers"] = sorted(covers)
    merged["cursors"] = dict(sorted(merged["cursors"].items(), key=lambda kv: int(kv[0])))
    return merged


def checked_state(
    state: dict[str, Any],
) -> tuple[int, dict[int, Cursor], int | None, int | None, set[int], list[tuple[int, int]] | None]:
    """``(epoch, cursors, readers, world_size, covers, plan)`` of a loaded state, each field checked against
    its type and bounds (a damaged or edited state raises a DataError naming the field, never a raw error)."""
    epoch = check_count("epoch", state.get("epoch"))
    readers, world = state.get("readers"), state.get("world_size")
    for name, value in (("readers", readers), ("world_size", world)):
        if value is not None and check_count(name, value) < 1:
            raise DataError(state_problem(name, value, "is not >= 1"))
    if readers is not None and world is not None and readers % world:
        raise DataError(state_problem("readers", readers, f"is not a multiple of world_size={world}"))
    saved = state.get("cursors", {})
    if not isinstance(saved, dict):
        raise DataError(state_problem("cursors", saved, "is not an object of readers' cursors"))
    cursors = {}
    for key, value in saved.items():
        reader = int(key) if isinstance(key, str) and key.isdigit() else -1
        if reader < 0 or (readers is not None and reader >= readers):
            raise DataError(
                state_problem(f"cursors[{key!r}]", key, f"is not a reader of 0..{(readers or 1) - 1}")
            )
        if isinstance(value, dict) and "audit" in value:  # a data audit tally (see _tallies)
            value = {k: v for k, v in value.items() if k != "audit"}
        cursors[reader] = Cursor.from_dict(value, f"cursors[{key!r}]")
    if cursors and readers is None:
        raise DataError(state_problem("readers", readers, "is missing beside the cursors"))
    listed = state.get("covers", sorted(cursors))
    if not isinstance(listed, list) or any(
        type(r) is not int or not 0 <= r < (readers or MAX_COUNT) for r in listed
    ):
        raise DataError(state_problem("covers", listed, "is not a list of this state's readers"))
    plan = state.get("plan")
    if plan is None:
        return epoch, cursors, readers, world, set(listed), None
    if not isinstance(plan, list):
        raise DataError(state_problem("plan", plan, "is not a list of [start, end) intervals"))
    intervals: list[tuple[int, int]] = []
    for i, pair in enumerate(plan):
        if not isinstance(pair, list | tuple) or len(pair) != 2:
            raise DataError(state_problem(f"plan[{i}]", pair, "is not a [start, end) pair"))
        a, b = check_count(f"plan[{i}][0]", pair[0]), check_count(f"plan[{i}][1]", pair[1])
        if a >= b or (intervals and a < intervals[-1][1]):
            raise DataError(
                state_problem(f"plan[{i}]", pair, "is empty, reversed or overlaps the interval before")
            )
        intervals.append((a, b))
    return epoch, cursors, readers, world, set(listed), intervals


def saved_tallies(state: dict[str, Any], epoch: int) -> dict[int, Tally]:
    """The data audit tallies saved beside a checked state's cursors (none in a state saved unaudited)."""
    return {
        int(key): Tally.from_dict(epoch, cursor["audit"], f"cursors[{key!r}].audit")
        for key, cursor in state.get("cursors", {}).items()
        if isinstance(cursor, dict) and "audit" in cursor
    }


def fingerprint(identity: Any, options: dict[str, Any], columnar: bool) -> str:
    """A short hash of what a state's positions mean: the data (``identity``: file names, sizes and
    versions, or a table id), the format and the options that order and share the records."""
    blob = json.dumps(
        [
            options["format"],
            identity,
            *(options[name] for name in ("shuffle", "seed", "shuffle_buffer", "equalize", "batch_size")),
            *(["columnar"] if columnar else []),
        ],
        sort_keys=True,
        default=str,
    )
    return hashlib.sha1(blob.encode()).hexdigest()[:16]


def short_format(fmt: Any) -> str:
    """A format's repr, shortened (e.g. Files with a thousand class names: the state stays small)."""
    text = repr(fmt)
    if len(text) > 160:
        text = f"{text[:80]}... (sha1 {hashlib.sha1(text.encode()).hexdigest()[:12]})"
    return text


def mismatch(saved: Any, now: dict[str, Any]) -> str:
    """Which options differ from the ones a state was saved with (``saved``: its ``options``)."""
    if not isinstance(saved, dict):
        return "files, sizes, format, shuffle, seed, shuffle_buffer, equalize or batch_size"
    changed = [
        f"{k}: saved {saved.get(k)}, now {v}" for k, v in now.items() if saved.get(k) != v and k != "versions"
    ]
    if not changed and saved.get("versions") != now["versions"]:
        changed = [
            "files: a file was rewritten since the state was saved (same names and sizes, other content "
            "on Cloud Storage or a new modification time on local disk), so the saved positions may fall "
            "elsewhere (a job that copies its data to local disk at each start keeps the modification "
            "times, e.g. `cp -p`, or reads it from gs:// or /gcs/ directly)"
        ]
    if not changed:  # same counts and sizes: a file was renamed or replaced by one of the same size
        changed = [f"files: the file names changed ({now['files']})"]
    return "; ".join(changed)

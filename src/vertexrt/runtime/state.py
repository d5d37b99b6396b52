"""Automatic tracking of a Trainer's checkpointable attributes (the idea of torchtnt's ``AppStateMixin``).

Assigning an attribute whose value has ``state_dict()``/``load_state_dict()`` (torch modules, optimizers,
LR schedulers, data readers, metric objects) or is a random generator (``random.Random``,
``numpy.random.Generator``, ``torch.Generator``) records it under the attribute's name; ``app_state()``
returns them as a dict the checkpoint manager can save and restore in place. Names starting with ``_``
and names listed in ``untracked`` are left alone.

Example:
    >>> import random
    >>> class T(StateTracker):
    ...     def __init__(self):
    ...         self.rng = random.Random(0)
    ...         self.lr = 0.1
    >>> sorted(T().app_state())
    ['rng']
"""

from __future__ import annotations

import random
from typing import Any, ClassVar, Protocol, runtime_checkable


@runtime_checkable
class Stateful(Protocol):
    """Anything with ``state_dict()`` and ``load_state_dict(state)``."""

    def state_dict(self) -> Any: ...

    def load_state_dict(self, state: Any) -> Any: ...


class GeneratorState:
    """A ``Stateful`` view of a random generator that lacks ``state_dict``.

    Supports ``random.Random`` (getstate/setstate), ``numpy.random.Generator`` (``bit_generator.state``)
    and ``torch.Generator`` (get_state/set_state).
    """

    def __init__(self, generator: Any) -> None:
        self.generator = generator

    def state_dict(self) -> Any:
        g = self.generator
        if isinstance(g, random.Random):
            version, internal, gauss = g.getstate()
            return {"version": version, "internal": list(internal), "gauss": gauss}
        if hasattr(g, "bit_generator"):
            return g.bit_generator.state
        return g.get_state()

    def load_state_dict(self, state: Any) -> None:
        g = self.generator
        if isinstance(g, random.Random):
            g.setstate((state["version"], tuple(state["internal"]), state["gauss"]))
        elif hasattr(g, "bit_generator"):
            g.bit_generator.state = state
        else:
            g.set_state(state)


def is_generator(value: Any) -> bool:
    """True for ``random.Random``, ``numpy.random.Generator`` and ``torch.Generator`` instances."""
    if isinstance(value, random.Random):
        return True
    kind = type(value)
    qualname = f"{kind.__module__}.{kind.__qualname__}"
    return qualname in ("numpy.random._generator.Generator", "torch._C.Generator", "torch.Generator")


#: How deep a JSON-able attribute may nest (deeper values are not saved).
MAX_JSON_DEPTH = 32


def is_json_value(value: Any, depth: int = 0) -> bool:
    """True for ``None``, bools, ints, floats, strings, and lists/tuples/str-keyed dicts of them.

    Example:
        >>> is_json_value({"losses": [0.5, 0.25], "epoch": 3}), is_json_value(object())
        (True, False)
    """
    kind = type(value)
    if value is None or kind in (bool, int, float, str):
        return True
    if depth >= MAX_JSON_DEPTH:
        return False
    if kind in (list, tuple):
        return all(is_json_value(item, depth + 1) for item in value)
    if kind is dict:
        return all(type(k) is str and is_json_value(v, depth + 1) for k, v in value.items())
    return False


def as_stateful(value: Any) -> Stateful | None:
    """``value`` itself if it is ``Stateful``, a ``GeneratorState`` for a generator, else ``None``."""
    if isinstance(value, type):
        return None
    if is_generator(value):
        return GeneratorState(value)
    if callable(getattr(value, "state_dict", None)) and callable(getattr(value, "load_state_dict", None)):
        return value
    return None


class StateTracker:
    """Mixin: remembers which attributes hold checkpointable state, in assignment order."""

    untracked: ClassVar[tuple[str, ...]] = ()
    """Attribute names never tracked (e.g. an evaluation reader that should restart at each evaluation)."""

    def __setattr__(self, name: str, value: Any) -> None:
        object.__setattr__(self, name, value)
        if name.startswith("_") or name in self.untracked:
            return
        tracked = self._tracked_attrs()
        stateful = as_stateful(value)
        if stateful is None:
            tracked.pop(name, None)
        else:
            tracked[name] = stateful

    def __delattr__(self, name: str) -> None:
        object.__delattr__(self, name)
        self._tracked_attrs().pop(name, None)

    def _tracked_attrs(self) -> dict[str, Stateful]:
        try:
            return object.__getattribute__(self, "_vertexrt_tracked")  # type: ignore[no-any-return]
        except AttributeError:
            tracked: dict[str, Stateful] = {}
            object.__setattr__(self, "_vertexrt_tracked", tracked)
            return tracked

    def app_state(self) -> dict[str, Stateful]:
        """The tracked attributes as ``{name: Stateful}`` (a new dict each call)."""
        return dict(self._tracked_attrs())

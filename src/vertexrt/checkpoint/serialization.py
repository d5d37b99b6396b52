"""The state tree <-> a JSON-able tree of nodes plus a list of byte leaves.

Plain JSON values (str, bool, None, 64-bit ints, finite floats) are stored inline. Containers and
everything else are ``{"t": kind, ...}`` nodes: ``dict`` (keys kept with their JSON type, so optimizer
state's int keys survive), ``list``, ``tuple``, ``int``/``float`` (big or non-finite), ``state`` (an object
with ``state_dict()``/``load_state_dict()``), ``keras`` (a model's weights), and byte leaves (``torch``,
``numpy``, ``tf``, ``bytes``, ``pickle``) whose bytes live in the data files.

Example:
    >>> tree, leaves = encode({"w": torch.ones(3), "step": 7}, allow_pickle=False)
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

from vertexrt.checkpoint import adapters
from vertexrt.checkpoint.adapters import Encoded
from vertexrt.errors import CheckpointError

ROOT = "state"
LEAF_KINDS = frozenset({"torch", "numpy", "tf", "bytes", "pickle"})
CONTAINER_KINDS = frozenset({"dict", "list", "tuple", "keras"})
_INT64 = (-(2**63), 2**63)
_KEY_TYPES = (str, int, float, bool, type(None))
_MISSING = object()


def encode(state: Any, *, allow_pickle: bool) -> tuple[Any, list[tuple[dict[str, Any], Encoded]]]:
    """Encode ``state``; returns the node tree and ``(leaf node, encoded bytes)`` pairs in tree order.

    Raises:
        CheckpointError: a value that cannot be saved, naming its path, e.g. ``state['opt']['fn']``.
    """
    leaves: list[tuple[dict[str, Any], Encoded]] = []
    optimizers: list[Any] = []
    tree = _encode(state, ROOT, leaves, allow_pickle, optimizers)
    _mark_optimizer_owned([enc for _, enc in leaves], optimizers)
    return tree, leaves


def _mark_optimizer_owned(encoded: list[Encoded], optimizers: list[Any]) -> None:
    """Flag leaves that are the very memory of a saved optimizer's parameters or state tensors (on a device
    or in host memory): only that optimizer's ``step()`` changes them, so staging copies them last."""
    if not optimizers:
        return
    owned: set[int | None] = set()
    for opt in optimizers:
        for group in opt.param_groups:
            owned.update(_address(p) for p in group["params"])
        for per_param in opt.state.values():
            values = per_param.values() if isinstance(per_param, Mapping) else ()
            owned.update(_address(v) for v in values if adapters.is_torch_tensor(v))
    owned.discard(None)
    for enc in encoded:
        if enc.nbytes and _leaf_address(enc) in owned:
            enc.optimizer_owned = True


def _address(tensor: Any) -> int | None:
    """The memory address of a plain tensor's data (None without storage: DTensor and other subclasses)."""
    try:
        return int(tensor.data_ptr())
    except RuntimeError:
        return None


def _leaf_address(enc: Encoded) -> int | None:
    """Where a leaf's bytes live: its device tensor, or live host memory (None for a private copy)."""
    if enc.data is None:
        return int(enc.device.data_ptr())
    if enc.owned:
        return None
    return int(enc.data.ctypes.data)


def leaf_places(tree: Any) -> dict[int, tuple[str | None, tuple[Any, ...]]]:
    """For each byte-leaf node (by ``id``): the class of the nearest object with ``state_dict()`` around it
    (None if none) and the keys / indices from that object (or the root) down to the leaf."""
    places: dict[int, tuple[str | None, tuple[Any, ...]]] = {}
    stack: list[tuple[Any, str | None, tuple[Any, ...]]] = [(tree, None, ())]
    while stack:
        node, owner, keys = stack.pop()
        if not isinstance(node, dict):
            continue
        kind = node.get("t")
        if kind in LEAF_KINDS:
            places[id(node)] = (owner, keys)
        elif kind == "dict":
            stack.extend((v, owner, (*keys, k)) for k, v in zip(node["k"], node["v"], strict=True))
        elif kind in CONTAINER_KINDS:
            stack.extend((v, owner, (*keys, i)) for i, v in enumerate(node["v"]))
        elif kind == "state":
            stack.append((node["v"], node.get("cls"), ()))
    return places


def leaf_nodes(tree: Any) -> list[dict[str, Any]]:
    """All byte-leaf nodes of an encoded tree, in tree order."""
    found: list[dict[str, Any]] = []
    stack = [tree]
    while stack:
        node = stack.pop()
        if not isinstance(node, dict):
            continue
        kind = node.get("t")
        if kind in LEAF_KINDS:
            found.append(node)
        elif kind in CONTAINER_KINDS:
            stack.extend(reversed(node["v"]))
        elif kind == "state":
            stack.append(node["v"])
    return found


def decode(
    tree: Any,
    values: Callable[[dict[str, Any]], Any],
    target: Any = _MISSING,
    place: Callable[[dict[str, Any], Any], Any] | None = None,
) -> Any:
    """Rebuild the state; ``values(node)`` gives a leaf's value. With ``target``, load into live objects.

    ``place(node, value)``, when given, maps each leaf value that is not loaded into a live target leaf
    (e.g. moves it to a device); leaves with a live target are copied into it straight from ``values``.
    """
    return _decode(tree, Leaves(values, place), target, ROOT)


class Leaves:
    """How :func:`decode` gets leaf values: ``values(node)``, then ``place`` for leaves without a target."""

    def __init__(
        self, values: Callable[[dict[str, Any]], Any], place: Callable[[dict[str, Any], Any], Any] | None
    ) -> None:
        self.values = values
        self.place = place

    def free(self, node: dict[str, Any]) -> Any:
        value = self.values(node)
        return value if self.place is None else self.place(node, value)


def _encode(
    value: Any,
    path: str,
    leaves: list[tuple[dict[str, Any], Encoded]],
    allow_pickle: bool,
    optimizers: list[Any],
) -> Any:
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, int):
        return int(value) if _INT64[0] <= value < _INT64[1] else {"t": "int", "v": str(int(value))}
    if isinstance(value, float):
        return float(value) if math.isfinite(value) else {"t": "float", "v": repr(float(value))}
    if isinstance(value, Mapping):
        keys = list(value.keys())
        for key in keys:
            if not isinstance(key, _KEY_TYPES) or (isinstance(key, float) and not math.isfinite(key)):
                raise CheckpointError(
                    f"{path}: key {key!r} of type {type(key).__name__} cannot be saved; use str or int keys"
                )
        items = [_encode(value[k], f"{path}[{k!r}]", leaves, allow_pickle, optimizers) for k in keys]
        return {"t": "dict", "k": keys, "v": items}
    if isinstance(value, (list, tuple)):
        kind = "list" if isinstance(value, list) else "tuple"
        items = [_encode(v, f"{path}[{i}]", leaves, allow_pickle, optimizers) for i, v in enumerate(value)]
        return {"t": kind, "v": items}
    try:
        encoded = _encode_leaf(value)
    except TypeError as exc:
        raise CheckpointError(f"{path}: cannot save {exc}") from None
    if encoded is not None:
        node = {"t": encoded.kind, **encoded.meta}
        leaves.append((node, encoded))
        return node
    if callable(getattr(value, "state_dict", None)) and callable(getattr(value, "load_state_dict", None)):
        if adapters.is_torch_optimizer(value):
            optimizers.append(value)
        inner = _encode(value.state_dict(), path, leaves, allow_pickle, optimizers)
        return {"t": "state", "cls": _qualname(value), "v": inner}
    if adapters.is_keras_model(value):
        weights = value.get_weights()
        items = [
            _encode(w, f"{path}.get_weights()[{i}]", leaves, allow_pickle, optimizers)
            for i, w in enumerate(weights)
        ]
        return {"t": "keras", "cls": _qualname(value), "v": items}
    if allow_pickle:
        encoded = adapters.encode_pickle(value)
        node = {"t": "pickle", **encoded.meta}
        leaves.append((node, encoded))
        return node
    raise CheckpointError(
        f"{path}: cannot save an object of type {_qualname(value)}. Checkpoints hold tensors, arrays, "
        "Python scalars/str/bytes/None, dicts/lists/tuples of them and objects with state_dict()/"
        "load_state_dict(); remove it from the state, or pass allow_pickle=True to the CheckpointManager"
    )


def _encode_leaf(value: Any) -> Encoded | None:
    if isinstance(value, (bytes, bytearray)):
        return adapters.encode_bytes(value)
    if adapters.is_torch_tensor(value):
        return adapters.encode_torch(value)
    if adapters.is_numpy(value):
        return adapters.encode_numpy(value)
    if adapters.is_tf_value(value) and not adapters.is_keras_model(value):
        if callable(getattr(value, "state_dict", None)):
            return None
        return adapters.encode_tf(value)
    return None


def _decode(node: Any, values: Leaves, target: Any, path: str) -> Any:
    if not isinstance(node, dict):
        return node
    kind = node.get("t")
    if kind == "int":
        return int(node["v"])
    if kind == "float":
        return float(node["v"])
    if kind == "dict":
        return _decode_dict(node, values, target, path)
    if kind in ("list", "tuple"):
        items = node["v"]
        if target is not _MISSING and isinstance(target, (list, tuple)) and len(target) != len(items):
            raise CheckpointError(
                f"{path}: the checkpoint holds {len(items)} items but the target has {len(target)}"
            )
        subs = list(target) if isinstance(target, (list, tuple)) else [_MISSING] * len(items)
        out = [
            _decode(v, values, t, f"{path}[{i}]") for i, (v, t) in enumerate(zip(items, subs, strict=True))
        ]
        return out if kind == "list" else tuple(out)
    if kind == "state":
        plain = _decode(node["v"], values, _MISSING, path)
        if target is not _MISSING and callable(getattr(target, "load_state_dict", None)):
            try:
                target.load_state_dict(plain)
            except CheckpointError:
                raise
            except Exception as exc:
                raise CheckpointError(f"{path}: {_qualname(target)}.load_state_dict failed: {exc}") from exc
            return target
        return plain
    if kind == "keras":
        weights = [
            _decode(v, values, _MISSING, f"{path}.get_weights()[{i}]") for i, v in enumerate(node["v"])
        ]
        if target is not _MISSING and callable(getattr(target, "set_weights", None)):
            try:
                target.set_weights(weights)
            except Exception as exc:
                raise CheckpointError(f"{path}: {_qualname(target)}.set_weights failed: {exc}") from exc
            return target
        return weights
    if kind in LEAF_KINDS:
        if target is _MISSING or target is None:
            return values.free(node)
        return adapters.assign(target, values.values(node), path)
    raise CheckpointError(
        f"{path}: unknown node kind {kind!r}: the checkpoint was written by a newer vertexrt"
    )


def _decode_dict(node: dict[str, Any], values: Leaves, target: Any, path: str) -> Any:
    keys, items = node["k"], node["v"]
    if target is _MISSING or target is None or not isinstance(target, Mapping):
        return {k: _decode(v, values, _MISSING, f"{path}[{k!r}]") for k, v in zip(keys, items, strict=True)}
    missing = [k for k in target if k not in set(keys)]
    if missing:
        raise CheckpointError(
            f"{path}: the target has keys {missing!r} that the checkpoint does not hold; "
            "restore without target= to see what it holds, or drop those keys from the target"
        )
    return {
        k: _decode(v, values, target.get(k, _MISSING), f"{path}[{k!r}]")
        for k, v in zip(keys, items, strict=True)
    }


def _qualname(value: Any) -> str:
    return f"{type(value).__module__}.{type(value).__qualname__}"

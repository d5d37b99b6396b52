"""Framework adapters: array-like leaves (torch, numpy, TensorFlow/Keras) <-> raw bytes and back.

A framework is only touched when a value of it is met, and a type is only checked against a framework
that is already imported (``sys.modules``), so saving plain state never imports torch or TensorFlow.

Each leaf kind encodes to ``(meta, data)``: JSON-able ``meta`` (dtype, shape) and a 1-D ``uint8`` numpy
array over the bytes (a view of live memory when possible; ``owned`` says it is already a private copy).
A tensor on an accelerator is not copied here: ``device`` holds its flat byte view and ``data`` is None
until :mod:`vertexrt.checkpoint.staging` copies it to host memory.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

from vertexrt.errors import CheckpointError

_FRAMEWORK_MODULES = ("tensorflow", "keras", "tf_keras")


@dataclass
class Encoded:
    """One leaf ready to write: its manifest fields and its bytes."""

    kind: str
    meta: dict[str, Any]
    data: Any  # numpy.ndarray, 1-D uint8, C-contiguous; None while the bytes are still on ``device``
    owned: bool  # True when ``data`` is already a private copy (no snapshot needed)
    device: Any = None  # a flat uint8 torch tensor on an accelerator, staged to host by ``staging``
    optimizer_owned: bool = False  # a saved optimizer's parameter / state: only its step() changes it

    @property
    def nbytes(self) -> int:
        return int(self.device.numel()) if self.data is None else len(self.data)


def is_torch_tensor(value: Any) -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(value, torch.Tensor)


def is_torch_optimizer(value: Any) -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(value, torch.optim.Optimizer)


def is_numpy(value: Any) -> bool:
    np = sys.modules.get("numpy")
    return np is not None and isinstance(value, (np.ndarray, np.generic))


def is_keras_model(value: Any) -> bool:
    return (
        type(value).__module__.split(".")[0] in _FRAMEWORK_MODULES
        and callable(getattr(value, "get_weights", None))
        and callable(getattr(value, "set_weights", None))
    )


def is_tf_value(value: Any) -> bool:
    """A tf.Variable / tf.Tensor / Keras variable: something with ``numpy()`` from a TF-family module."""
    return type(value).__module__.split(".")[0] in _FRAMEWORK_MODULES and callable(
        getattr(value, "numpy", None)
    )


def encode_torch(tensor: Any) -> Encoded:
    import torch

    if tensor.layout != torch.strided or tensor.is_quantized:
        raise TypeError(f"a {tensor.layout} / quantized tensor (only dense tensors are supported)")
    flat = tensor.detach().resolve_conj().resolve_neg().contiguous().reshape(-1)
    meta = {"dtype": str(tensor.dtype).removeprefix("torch."), "shape": list(tensor.shape)}
    if not flat.numel():
        data = _empty_bytes()
    elif tensor.device.type != "cpu":  # no copy here: staging copies it without blocking the caller
        meta["device"] = str(tensor.device)
        return Encoded("torch", meta, None, False, flat.view(torch.uint8))
    else:
        data = flat.view(torch.uint8).numpy()
    if tensor.device.type != "cpu":
        meta["device"] = str(tensor.device)
    return Encoded("torch", meta, data, False)


def encode_numpy(array: Any) -> Encoded:
    import numpy as np

    scalar = isinstance(array, np.generic)
    arr = _contiguous(array)
    if arr.dtype.hasobject or arr.dtype.fields is not None or arr.dtype.kind == "V":
        raise TypeError(f"a numpy array of dtype {arr.dtype} (object/structured dtypes are not supported)")
    meta: dict[str, Any] = {"dtype": arr.dtype.str, "shape": list(arr.shape)}
    if scalar:
        meta["scalar"] = True
    return Encoded("numpy", meta, _bytes_view(arr), scalar)


def encode_tf(value: Any) -> Encoded:

    arr = _contiguous(value.numpy())
    dtype = getattr(value, "dtype", arr.dtype)
    name = getattr(dtype, "name", None) or str(dtype)
    return Encoded("tf", {"dtype": str(name), "shape": list(arr.shape)}, _bytes_view(arr), True)


def encode_bytes(value: bytes | bytearray) -> Encoded:
    import numpy as np

    return Encoded("bytes", {}, np.frombuffer(bytes(value), dtype=np.uint8), True)


def encode_pickle(value: Any) -> Encoded:
    import pickle

    import numpy as np

    blob = pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
    return Encoded("pickle", {"type": _qualname(value)}, np.frombuffer(blob, dtype=np.uint8), True)


def value(kind: str, meta: dict[str, Any], buffer: Any) -> Any:
    """The leaf's value over ``buffer`` (1-D uint8, possibly a view of a memory-mapped file)."""

    if kind == "torch":
        import torch

        dtype = getattr(torch, meta["dtype"], None)
        if not isinstance(dtype, torch.dtype):
            raise CheckpointError(f"unknown torch dtype {meta['dtype']!r}: upgrade torch to read it")
        if len(buffer) == 0:
            return torch.empty(meta["shape"], dtype=dtype)
        if not buffer.flags.writeable:
            buffer = buffer.copy()
        return torch.from_numpy(buffer).view(dtype).reshape(meta["shape"])
    if kind in ("numpy", "tf"):
        arr = buffer.view(_numpy_dtype(meta["dtype"])).reshape(meta["shape"])
        return arr[()] if meta.get("scalar") else arr
    if kind == "bytes":
        return buffer.tobytes()
    if kind == "pickle":
        import pickle

        return pickle.loads(buffer.tobytes())  # noqa: S301 - only with allow_pickle=True
    raise CheckpointError(f"unknown leaf kind {kind!r}: the checkpoint was written by a newer vertexrt")


def assign(target: Any, value: Any, path: str) -> Any:
    """Copy ``value`` into the live ``target`` (tensor, array, variable) and return it; else return value."""
    if is_torch_tensor(target):
        import torch

        source = value if is_torch_tensor(value) else torch.as_tensor(value)
        _check_shape(tuple(target.shape), tuple(source.shape), path)
        from vertexrt.checkpoint import uploads

        with torch.no_grad():
            if not uploads.copy_to_device(source, target):  # a CUDA target: pinned, non-blocking
                target.copy_(source)
        return target
    if is_numpy(target) and not _is_np_scalar(target):
        import numpy as np

        source = value.numpy() if is_torch_tensor(value) else np.asarray(value)
        _check_shape(tuple(target.shape), tuple(source.shape), path)
        if target.flags.writeable:
            np.copyto(target, source, casting="unsafe")
            return target
        return source
    if is_tf_value(target) and callable(getattr(target, "assign", None)):
        source = value.numpy() if is_torch_tensor(value) else value
        _check_shape(tuple(target.shape), tuple(getattr(source, "shape", ())), path)
        target.assign(source)
        return target
    return value


def _check_shape(expected: tuple[int, ...], got: tuple[int, ...], path: str) -> None:
    if tuple(expected) != tuple(got):
        raise CheckpointError(
            f"{path}: the checkpoint holds shape {list(got)} but the target has shape {list(expected)}; "
            "restore into a model built with the same configuration, or restore without target="
        )


def _numpy_dtype(name: str) -> Any:
    import numpy as np

    try:
        return np.dtype(name)
    except TypeError:
        pass
    try:
        import ml_dtypes

        return np.dtype(getattr(ml_dtypes, name))
    except (ImportError, AttributeError):
        raise CheckpointError(f"dtype {name!r} needs ml_dtypes (installed with TensorFlow/JAX) to be read")


def _contiguous(value: Any) -> Any:
    import numpy as np

    arr = np.asarray(value)
    return arr if arr.flags.c_contiguous else arr.copy(order="C")


def _bytes_view(arr: Any) -> Any:
    import numpy as np

    if arr.size == 0:
        return _empty_bytes()
    flat = arr.reshape(-1)
    try:
        return flat.view(np.uint8)
    except ValueError:  # ml_dtypes etc. that refuse a view: copy through bytes
        return np.frombuffer(flat.tobytes(), dtype=np.uint8)


def _empty_bytes() -> Any:
    import numpy as np

    return np.empty(0, dtype=np.uint8)


def _is_np_scalar(value: Any) -> bool:
    np = sys.modules.get("numpy")
    return np is not None and isinstance(value, np.generic)


def _qualname(value: Any) -> str:
    return f"{type(value).__module__}.{type(value).__qualname__}"

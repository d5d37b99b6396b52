"""Random number generator state as a checkpointable object.

Put ``rng_state()`` in the saved state: it captures, at save time, the generators of the frameworks already
imported (Python ``random``, numpy's global generator, torch CPU and CUDA, TensorFlow's global generator)
and sets them back when restored in place.

Example:
    >>> state = {"model": model, "rng": vertexrt.checkpoint.rng_state()}
    >>> mgr.save(step, state)
    >>> mgr.restore(target=state)   # the generators continue where they were at save time
"""

from __future__ import annotations

import logging
import random
import sys
from typing import Any

log = logging.getLogger(__name__)


class RngState:
    """The global RNG states; ``state_dict()`` reads them now, ``load_state_dict()`` sets them."""

    def state_dict(self) -> dict[str, Any]:
        version, internal, gauss = random.getstate()
        state: dict[str, Any] = {"python": {"version": version, "state": list(internal), "gauss": gauss}}
        np = sys.modules.get("numpy")
        if np is not None:
            name, keys, pos, has_gauss, cached = np.random.get_state()
            state["numpy"] = {
                "name": name,
                "keys": keys,
                "pos": int(pos),
                "has_gauss": int(has_gauss),
                "cached": float(cached),
            }
        torch = sys.modules.get("torch")
        if torch is not None:
            state["torch"] = torch.get_rng_state()
            if torch.cuda.is_available() and torch.cuda.is_initialized():
                state["cuda"] = list(torch.cuda.get_rng_state_all())
                state["cuda_current"] = torch.cuda.current_device()
        tf = sys.modules.get("tensorflow")
        if tf is not None and hasattr(tf, "random"):
            generator = tf.random.get_global_generator()
            state["tensorflow"] = {"state": generator.state.numpy(), "algorithm": int(generator.algorithm)}
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        py = state["python"]
        random.setstate((py["version"], tuple(py["state"]), py["gauss"]))
        if "numpy" in state:
            import numpy as np

            s = state["numpy"]
            np.random.set_state(
                (s["name"], np.asarray(s["keys"], dtype=np.uint32), s["pos"], s["has_gauss"], s["cached"])
            )
        if "torch" in state:
            import torch

            torch.set_rng_state(_cpu_bytes(state["torch"]))
            if "cuda" in state and torch.cuda.is_available():
                chosen = cuda_states_to_set(
                    len(state["cuda"]),
                    state.get("cuda_current"),
                    visible=torch.cuda.device_count(),
                    current=torch.cuda.current_device(),
                )
                for device, saved in chosen.items():
                    torch.cuda.set_rng_state(_cpu_bytes(state["cuda"][saved]), device)
        if "tensorflow" in state:
            import tensorflow as tf

            tf.random.get_global_generator().reset(state["tensorflow"]["state"])


def cuda_states_to_set(
    saved: int, saved_current: int | None, *, visible: int, current: int
) -> dict[int, int]:
    """Which saved CUDA generator state each visible GPU gets: ``{device: index into the saved list}``.

    With as many GPUs visible as were saved, each gets its own. With fewer (e.g. saved with 8 visible,
    restored with ``CUDA_VISIBLE_DEVICES`` showing one per process), the current device gets the state of
    the device that was current at save time, the other visible ones theirs where saved; the states of GPUs
    not visible here are skipped with a warning (never an ``IndexError`` that stops the resume).
    """
    if saved <= visible:
        return {i: i for i in range(saved)}
    chosen = {i: i for i in range(visible)}
    if saved_current is not None and 0 <= saved_current < saved:
        chosen[current] = saved_current
    log.warning(
        "the checkpoint holds CUDA RNG states of %d GPUs but %d are visible here: cuda:%d continues the "
        "generator of the GPU that was current at save time (cuda:%s); the states of the others are skipped",
        saved,
        visible,
        current,
        saved_current if saved_current is not None else current,
    )
    return chosen


def _cpu_bytes(value: Any) -> Any:
    """A generator state as the CPU ByteTensor torch's setters require, wherever it was restored to."""
    import torch

    return torch.as_tensor(value).to(device="cpu", dtype=torch.uint8)


def rng_state() -> RngState:
    """An object to put in the checkpoint state so RNGs are saved and restored with it."""
    return RngState()

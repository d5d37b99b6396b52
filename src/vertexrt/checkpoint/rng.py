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

import random
import sys
from typing import Any


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

            torch.set_rng_state(torch.as_tensor(state["torch"], dtype=torch.uint8))
            if "cuda" in state and torch.cuda.is_available():
                torch.cuda.set_rng_state_all([torch.as_tensor(s, dtype=torch.uint8) for s in state["cuda"]])
        if "tensorflow" in state:
            import tensorflow as tf

            tf.random.get_global_generator().reset(state["tensorflow"]["state"])


def rng_state() -> RngState:
    """An object to put in the checkpoint state so RNGs are saved and restored with it."""
    return RngState()

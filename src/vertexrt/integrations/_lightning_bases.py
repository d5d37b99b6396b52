"""The Lightning base classes of vertexrt's plugins and callback, accepted by either Lightning package.

Lightning ships twice: ``lightning`` (``lightning.pytorch``, ``lightning.fabric``) and the standalone
``pytorch_lightning`` / ``lightning_fabric`` packages that many samples import. Each Trainer checks plugins
and callbacks with ``isinstance`` against its own copy of the base classes, so a plugin derived from one
package's class is refused by the other's Trainer ("Expected one of: ... ClusterEnvironment"). Where the
standalone packages are installed, each base here derives from both copies, so the same object serves
``lightning.pytorch.Trainer``, ``pytorch_lightning.Trainer`` and either Fabric.
"""

from __future__ import annotations

import importlib
import types
from typing import TYPE_CHECKING

from lightning.fabric.plugins.environments.cluster_environment import ClusterEnvironment as _Environment
from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO as _CheckpointIO
from lightning.pytorch.callbacks import Callback as _Callback

__all__ = ["Callback", "CheckpointIO", "ClusterEnvironment"]


def _also_standalone(base: type, module: str) -> type:
    """`base`, or a class deriving from `base` and the class of the same name in the standalone `module`."""
    try:
        twin = getattr(importlib.import_module(module), base.__name__)
    except ImportError:  # the standalone package is not installed: `lightning` alone is served
        return base
    return types.new_class(base.__name__, (base, twin), exec_body=lambda ns: ns.update(__module__=__name__))


if TYPE_CHECKING:
    ClusterEnvironment = _Environment
    CheckpointIO = _CheckpointIO
    Callback = _Callback
else:
    ClusterEnvironment = _also_standalone(
        _Environment, "lightning_fabric.plugins.environments.cluster_environment"
    )
    CheckpointIO = _also_standalone(_CheckpointIO, "lightning_fabric.plugins.io.checkpoint_io")
    Callback = _also_standalone(_Callback, "pytorch_lightning.callbacks")

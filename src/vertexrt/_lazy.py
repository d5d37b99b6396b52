"""Lazy re-exports for the packages' ``__init__`` modules: a public name is imported from the module that
defines it on first use, so importing a package loads no framework and no cloud client.

Example:
    >>> __getattr__, __dir__ = lazy_exports(__name__, {"open_dataset": "vertexrt.data.dataset"})
"""

from __future__ import annotations

import importlib
import sys

TYPE_CHECKING = False  # not `from typing import ...`: `import vertexrt` stays cheap
if TYPE_CHECKING:
    from collections.abc import Callable, Iterable


def lazy_exports(
    package: str,
    exports: dict[str, str],
    submodules: Iterable[str] = (),
    listed: Iterable[str] = (),
) -> tuple[Callable[[str], object], Callable[[], list[str]]]:
    """The module ``__getattr__`` and ``__dir__`` of ``package``: ``exports`` maps a public name to the
    module defining it, ``submodules`` are attributes imported as ``package.name``; a resolved value is
    cached in the package, so each name is looked up once. ``dir()`` lists ``listed`` and both."""
    submodules = frozenset(submodules)
    names = sorted({*listed, *exports, *submodules})

    def __getattr__(name: str) -> object:
        if name in exports:
            value = getattr(importlib.import_module(exports[name]), name)
        elif name in submodules:
            value = importlib.import_module(f"{package}.{name}")
        else:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        setattr(sys.modules[package], name, value)
        return value

    def __dir__() -> list[str]:
        return names

    return __getattr__, __dir__

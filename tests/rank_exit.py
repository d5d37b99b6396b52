"""Leaving a rank process with ``os._exit`` once its verdict is out.

torch 2.13 sometimes aborts the interpreter's teardown of gloo (SIGABRT, "terminate called without an
active exception"), even after ``destroy_process_group()``, after a rank has checked and reported everything.
A test's verdict must not depend on that: rank workers end through :func:`exit_after` (scripts) or
:func:`exits_hard` (functions started by ``torch.multiprocessing.start_processes``).
"""

from __future__ import annotations

import functools
import os
import sys
import traceback
from collections.abc import Callable
from typing import Any, NoReturn


def exit_after(main: Callable[[], object]) -> NoReturn:
    """Run ``main``, flush, ``os._exit`` with its code: 0, a ``SystemExit``'s, or 1 (traceback on stderr)."""
    code = 0
    try:
        main()
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def exits_hard(fn: Callable[..., object]) -> Callable[..., NoReturn]:
    """``fn`` as a spawned rank's entry point that ends through :func:`exit_after`."""

    @functools.wraps(fn)
    def rank_entry(*args: Any) -> NoReturn:
        exit_after(lambda: fn(*args))

    return rank_entry

"""The one base of this library's errors, so a user can catch "an error from crystal-grpo"
and the command lines answer each of them in one line (exit code 2) instead of a traceback.

Every error class keeps a built-in base as well (``ValueError`` for bad input,
``RuntimeError`` for what failed while running), so code that caught those still does.
"""

from __future__ import annotations

import os
import traceback

#: Set (to 1) in the environment, the command lines print Python's traceback of an error too.
TRACEBACK_VARIABLE = "CRYSTAL_GRPO_TRACEBACK"


class CrystalError(Exception):
    """An error of this library, phrased for the person who runs it: what, where, what to do."""


def some_of(items: list[str], most: int = 4, sep: str = ", ") -> str:
    """``a, b, c, d and 3 more``: a list short enough for a one-line message."""
    return sep.join(items[:most]) + (f"{sep}and {len(items) - most} more" if len(items) > most else "")


def traceback_if_asked(err: BaseException) -> None:
    """Python's traceback of ``err`` on stderr when :data:`TRACEBACK_VARIABLE` is set: the command
    lines say an error in one line, and this keeps the rest at hand for debugging."""
    if os.environ.get(TRACEBACK_VARIABLE, "").strip() not in ("", "0"):
        traceback.print_exception(err)

"""The one base of this library's errors, so a user can catch "an error from crystal-grpo"
and the command lines answer each of them in one line (exit code 2) instead of a traceback.

Every error class keeps a built-in base as well (``ValueError`` for bad input,
``RuntimeError`` for what failed while running), so code that caught those still does.
"""

from __future__ import annotations


class CrystalError(Exception):
    """An error of this library, phrased for the person who runs it: what, where, what to do."""


def some_of(items: list[str], most: int = 4, sep: str = ", ") -> str:
    """``a, b, c, d and 3 more``: a list short enough for a one-line message."""
    return sep.join(items[:most]) + (f"{sep}and {len(items) - most} more" if len(items) > most else "")

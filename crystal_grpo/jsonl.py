"""JSON files: the one JSON Lines reader (data files, prediction files, run logs) and the
atomic writer and forgiving reader of the JSON records a run keeps.

Every consumer needs the same per-line facts (line number, the parsed value or why the
line is unreadable) and differs only in what it does with a bad line: data and
prediction files report it as ``file:line: problem``; a run's own logs skip it (a line
cut off when the run was killed).
"""

from __future__ import annotations

import gzip
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from crystal_grpo.errors import CrystalError


@dataclass(frozen=True)
class Unreadable:
    """A line that is not a JSON value, and why."""

    problem: str


class DuplicateKeyError(CrystalError, ValueError):
    """A JSON object that gives one key twice: ``json`` keeps the last value without a word."""


def unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """``object_pairs_hook`` that refuses a key given twice in one object."""
    obj = dict(pairs)
    if len(obj) < len(pairs):
        seen: set[str] = set()
        key = next(k for k, _ in pairs if k in seen or seen.add(k))
        raise DuplicateKeyError(f"key {key!r} given twice in one object (which value is meant?)")
    return obj


GZIP_MAGIC = b"\x1f\x8b"


def open_bytes(path: str | Path) -> IO[bytes]:
    """The file's bytes, decompressed when it is gzip (``train.jsonl.gz``, as ``datasets`` reads it)."""
    with open(path, "rb") as fh:
        compressed = fh.read(2) == GZIP_MAGIC
    return gzip.open(path, "rb") if compressed else open(path, "rb")


def iter_jsonl(path: str | Path) -> Iterator[tuple[int, Any]]:
    """(line number, parsed value or :class:`Unreadable`) for each non-blank line; a UTF-8 byte
    order mark before the first line is read past, as Python's ``utf-8-sig`` does."""
    with open_bytes(path) as fh:
        for no, raw in enumerate(fh, 1):
            try:
                line = raw.decode("utf-8-sig" if no == 1 else "utf-8")
            except UnicodeDecodeError as err:
                yield no, Unreadable(f"not UTF-8 text ({err.reason} at byte {err.start})")
                continue
            if not line.strip():
                continue
            try:
                yield no, json.loads(line, object_pairs_hook=unique_keys)
            except DuplicateKeyError as err:
                yield no, Unreadable(str(err))
            except json.JSONDecodeError as err:
                yield no, Unreadable(f"invalid JSON ({err.msg} at column {err.colno})")
            except (ValueError, RecursionError) as err:  # an int past 4,300 digits, absurd nesting
                yield no, Unreadable(f"unreadable JSON ({type(err).__name__}: {str(err)[:100]})")


def read_jsonl(path: str | Path) -> list[dict]:
    """The JSON-object rows of a log; missing file: none; unreadable lines are skipped."""
    try:
        return [row for _, row in iter_jsonl(path) if isinstance(row, dict)]
    except OSError:
        return []


# --- JSON records that a kill must not leave half-written ---------------------------------
def atomic_write_text(path: str | Path, text: str) -> None:
    """Write-then-rename: readers see the old file or the new one, never a torn one."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def read_json(path: str | Path) -> Any:
    """The parsed file, or None when it is missing or unreadable (e.g. written by an older version)."""
    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None

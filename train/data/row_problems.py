"""What is wrong with a row (docs/method.md section 1), in words its author can act on.

Each problem is one phrase; ``train.data.load_split`` prefixes it with the row's ``file:line``
and, where ``data.columns`` renamed a column, names the column as the data does.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from crystal_grpo.jsonl import Unreadable
from crystal_grpo.train.data.images import image_paths, image_problem


def _is_text(x: Any) -> bool:
    return isinstance(x, str) and bool(x.strip())


def row_problems(row: Any, base: Path, require_references: bool = True) -> list[str]:
    """What is wrong with one row (empty when it is fine). Without ``require_references`` a row
    may lack reference steps (what ``build_references`` fills in); given ones are still checked."""
    if isinstance(row, Unreadable):
        return [row.problem]
    if not isinstance(row, dict):
        return [f"expected a JSON object, got {type(row).__name__}"]
    out = []
    if not _is_text(row.get("question")):
        out.append("missing or empty 'question'")
    ans = row.get("answer")
    if isinstance(ans, float) and not math.isfinite(ans):
        out.append(f"'answer' is {ans} (JSON NaN/Infinity): it must be a string or a finite number")
    elif isinstance(ans, bool) or not (_is_text(ans) or isinstance(ans, (int, float))):
        out.append("missing or empty 'answer' (a string or number)")
    steps = row.get("reference_steps")
    if (require_references or steps not in (None, [])) and (
        not isinstance(steps, list) or not steps or not all(_is_text(s) for s in steps)
    ):
        out.append("'reference_steps' must be a non-empty list of non-empty strings")
    sets = row.get("reference_sets")
    if sets is not None and not (
        isinstance(sets, list) and all(isinstance(c, list) and c and all(_is_text(s) for s in c) for c in sets)
    ):
        out.append("'reference_sets' must be a list of non-empty lists of strings")
    choices = row.get("choices")
    if choices is not None and not (isinstance(choices, list) and all(_is_text(c) for c in choices)):
        out.append("'choices' must be a list of strings")
    for img in image_paths(row, base):
        out.extend(image_problem(img))
    return out


def name_columns(problem: str, columns: Mapping[str, str]) -> str:
    """A problem worded with the data's own column names where data.columns renamed them."""
    for ours, theirs in columns.items():
        problem = problem.replace(f"'{ours}'", f"'{theirs}' (data.columns.{ours})")
    return problem

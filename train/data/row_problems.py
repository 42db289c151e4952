"""What is wrong with a row (docs/method.md section 1), in words its author can act on.

Each problem is one phrase; ``train.data.load_split`` prefixes it with the row's ``file:line``
and, where ``data.columns`` renamed a column, names the column as the data does.
"""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from crystal_grpo.jsonl import Unreadable
from crystal_grpo.train.data.images import image_paths, image_problem

#: Options a prompt can letter (A-Z: train/data/prompts.py build_prompt).
MAX_CHOICES = 26


def _is_text(x: Any) -> bool:
    return isinstance(x, str) and bool(x.strip())


def row_problems(
    row: Any, base: Path, require_references: bool = True, special_tokens: Sequence[str] = ()
) -> list[str]:
    """What is wrong with one row (empty when it is fine). Without ``require_references`` a row
    may lack reference steps (what ``build_references`` fills in); given ones are still checked.
    ``special_tokens``: the model's (train/models/loading.py), which the prompt's text must not hold."""
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
    elif isinstance(choices, list) and len(choices) > MAX_CHOICES:
        out.append(f"'choices' has {len(choices)} options; a prompt letters them A to Z, so at most {MAX_CHOICES}")
    for img in image_paths(row, base):
        out.extend(image_problem(img))
    injected = special_token_problem(row, special_tokens)
    if injected:
        out.append(injected)
    return out


#: Why a special token in a prompt's text is refused (after ``'question' holds '<|im_end|>', ``).
INJECTION = (
    "a special token of the model's tokenizer: the rendered prompt would read it as a chat-template control token, "
    "not as text (a prompt injection); remove it"
)


def special_token_in(text: Any, special_tokens: Sequence[str]) -> str | None:
    """The first of ``special_tokens`` that ``text`` holds (the longest, where several start there), or None."""
    if not isinstance(text, str) or not special_tokens:
        return None
    found = _any_of(tuple(special_tokens)).search(text)
    return found[0] if found else None


@functools.lru_cache(maxsize=8)
def _any_of(tokens: tuple[str, ...]) -> re.Pattern:
    """One pattern for the tokens, longest first (a scan a row, not one a token)."""
    return re.compile("|".join(map(re.escape, sorted(tokens, key=len, reverse=True))))


def special_token_problem(row: dict, special_tokens: Sequence[str]) -> str | None:
    """Why the row's prompt text (its question and options) would change the rendered chat: it
    holds one of the model's special tokens, which the tokenizer reads as that token, not as text
    (``<|im_end|>`` then ``<|im_start|>assistant`` end the user's turn and write the model's)."""
    for key in ("question", "choices"):
        value = row.get(key)
        for text in [value] if isinstance(value, str) else value if isinstance(value, list) else []:
            hit = special_token_in(text, special_tokens)
            if hit:
                return f"{key!r} holds {hit!r}, {INJECTION}"
    return None


def system_prompt_problem(system_prompt: str | None, special_tokens: Sequence[str]) -> str | None:
    """The same for ``data.system_prompt``, which every prompt starts with."""
    hit = special_token_in(system_prompt, special_tokens)
    return f"data.system_prompt holds {hit!r}, {INJECTION}" if hit else None


def longest_chain(row: Any) -> int:
    """The most steps of one of the row's reference chains (``reference_steps`` or ``reference_sets``)."""
    if not isinstance(row, dict):
        return 0
    chains = [row.get("reference_steps"), *(row.get("reference_sets") or [])]
    return max((len(c) for c in chains if isinstance(c, list)), default=0)


def long_references_line(source: str, longest: Sequence[tuple[str, int]], limit: int) -> str | None:
    """A warning when rows' reference chains are longer than ``limit`` steps (``longest``: each
    such row's place and its longest chain): in training a completion with more steps than that
    scores step metrics 0 (rewards/batch.py MAX_SCORED_STEPS), so one that writes every reference
    step is paid nothing for them."""
    over = [(where, n) for where, n in longest if n > limit]
    if not over:
        return None
    where, n = max(over, key=lambda x: x[1])
    return (
        f"{source}: {len(over)} row(s) hold a reference chain of more than {limit} steps (e.g. {where}: {n}); "
        f"a reward scores at most {limit} steps a completion (past that its step score is 0), so a completion "
        "writing every reference step of these rows is paid nothing for its steps"
    )


def name_columns(problem: str, columns: Mapping[str, str]) -> str:
    """A problem worded with the data's own column names where data.columns renamed them."""
    for ours, theirs in columns.items():
        problem = problem.replace(f"'{ours}'", f"'{theirs}' (data.columns.{ours})")
    return problem

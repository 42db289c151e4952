"""The facts a formal step states, and the step gate built on them (docs/rewards.md, "The step gate").

A sentence encoder cannot see a wrong number: all-MiniLM-L6-v2 scores a step and the same step
with one number changed far above tau. With ``step_gate: facts`` the encoder's similarity stays,
but a predicted and a reference step can match only when the facts they state agree. A step's
facts are its numbers (read as the answer judge reads them), operators and variables, in
reading order; two steps agree when the sequences are equal, numbers within the answer judge's
tolerance. What counts as a fact, and why: docs/rewards.md, "The step gate".
"""

from __future__ import annotations

import functools
import math
import re
import unicodedata
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from crystal_grpo.rewards.answers import DIGITS, EXPONENT, PERCENT, PLAIN_PUNCTUATION, Number
from crystal_grpo.rewards.text import clean_text

if TYPE_CHECKING:
    import torch

#: ``step_gate`` of the scorer and of ``reward.params``: none (the similarity alone) or facts.
StepGate = Literal["none", "facts"]
#: The skeleton's place-holder for a number.
NUMBER = "#"
OPERATOR_WORDS = {"plus": "+", "minus": "-", "times": "*", "multiplied by": "*", "divided by": "/"}
OPERATOR_SYMBOLS = {"×": "*", "·": "*", "÷": "/", "<=": "≤", ">=": "≥", "!=": "≠"}
#: Beside one of these (spaces skipped) a lone "a" or "i" is a variable.
_MATHS_NEIGHBOURS = frozenset("+-*/^×·÷<>≤≥≠√=()[]{}")
_ARTICLE_LIKE = frozenset("ai")
# One token a match, tried in this order at each position; every alternative runs in linear time
# (each whitespace run can be read by one repetition only).
_TOKEN = re.compile(
    r"(?P<skip>\*\*+|__+|`+|->|=>|→|⇒)"
    r"|(?P<number>(?<![\w.])(?:[$€£¥₹]\s*)?" + DIGITS + EXPONENT + PERCENT + ")"
    r"|(?P<opword>\b(?:plus|minus|times|multiplied\s+by|divided\s+by)\b)"
    r"|(?P<word>[^\W\d_]{2,}(?:-[^\W\d_]{2,})*)"
    r"|(?P<variable>(?<![^\W\d_])[^\W\d_](?:\d+|_[^\W_]+)?'*(?![^\W_]))"
    r"|(?P<operator><=|>=|!=|[-+*/^×·÷<>≤≥≠√])"
)
#: A step's leading label ("Step 2:", "2.", "(2)", "2)") is not a fact.
_LABEL = re.compile(r"\s*(?:step\s*\d+\s*[.):]?|\(?\d+[.):])\s+")
_NUMBER_PARTS = re.compile(r"(?:[$€£¥₹]\s*)?" + DIGITS + EXPONENT + PERCENT)
_SPACE = re.compile(r"\s+")


@dataclass(frozen=True)
class Facts:
    """What a step states: ``skeleton`` has one entry per fact (:data:`NUMBER` for a number, else the
    operator or variable), ``numbers`` the numbers in order. Hashable: equal facts are one key."""

    skeleton: tuple[str, ...]
    numbers: tuple[Number, ...]


def _number(token: str) -> Number:
    digits, exponent, percent = _NUMBER_PARTS.fullmatch(token).groups()
    value = float(digits.replace(",", ""))
    if exponent:
        value *= float("1e" + exponent)  # overflows to inf, never raises
    # A number beyond float range is NaN, a new object each time: it agrees with no other number
    # (NaN is unequal to everything, and identical only to itself).
    return Number(value if math.isfinite(value) else float("nan"), bool(percent))


def _beside_maths(text: str, start: int, end: int) -> bool:
    """Whether the nearest non-space character before ``start`` or after ``end`` is a maths symbol
    (each whitespace run is walked from its two ends at most: linear in the text overall)."""
    i = start - 1
    while i >= 0 and text[i].isspace():
        i -= 1
    j = end
    while j < len(text) and text[j].isspace():
        j += 1
    return (i >= 0 and text[i] in _MATHS_NEIGHBOURS) or (j < len(text) and text[j] in _MATHS_NEIGHBOURS)


def _operator_words(tokens: list[re.Match], text: str) -> list[bool]:
    """Which tokens are operator words that act as operators: each is joined (by spaces only) to an
    operand on both sides ("9 plus 3"; not "3 times bigger", not "times, 4")."""
    operand = [m.lastgroup in ("number", "variable") for m in tokens]
    joined = [not text[a.end() : b.start()].strip() for a, b in zip(tokens, tokens[1:])]  # token i and i + 1
    return [
        m.lastgroup == "opword"
        and 0 < i < len(tokens) - 1
        and operand[i - 1]
        and operand[i + 1]
        and joined[i - 1]
        and joined[i]
        for i, m in enumerate(tokens)
    ]


@functools.lru_cache(maxsize=1 << 16)
def step_facts(step: str) -> Facts:
    """The facts ``step`` states (docs/rewards.md, "The step gate"). Any str reads without raising."""
    text = unicodedata.normalize("NFKC", clean_text(step)).translate(PLAIN_PUNCTUATION).casefold()
    label = _LABEL.match(text)
    text = text[label.end() :] if label else text
    tokens = list(_TOKEN.finditer(text))
    acts = _operator_words(tokens, text)
    beside_word = lambda i: (i > 0 and acts[i - 1]) or (i + 1 < len(acts) and acts[i + 1])
    skeleton: list[str] = []
    numbers: list[Number] = []
    for i, m in enumerate(tokens):
        kind, token = m.lastgroup, m.group(m.lastgroup)
        if kind == "number":
            skeleton.append(NUMBER)
            numbers.append(_number(token))
        elif kind == "opword" and acts[i]:
            skeleton.append(OPERATOR_WORDS[_SPACE.sub(" ", token)])
        elif kind == "operator":
            skeleton.append(OPERATOR_SYMBOLS.get(token, token))
        elif kind == "variable" and (
            token not in _ARTICLE_LIKE or beside_word(i) or _beside_maths(text, m.start(), m.end())
        ):
            skeleton.append(token)
    return Facts(tuple(skeleton), tuple(numbers))


def numbers_agree(
    facts: Sequence[Facts], a: torch.Tensor, b: torch.Tensor, rel_tol: float, abs_tol: float
) -> torch.Tensor:
    """``[P]`` bool: whether ``facts[a[p]]`` and ``facts[b[p]]`` (the same count of numbers) have their
    numbers pairwise equal in order, as ``answers.numbers_match`` compares two numbers, all at once."""
    import torch

    counts = torch.tensor([len(f.numbers) for f in facts], dtype=torch.long)
    start = torch.cumsum(counts, 0) - counts
    values = torch.tensor([n.value for f in facts for n in f.numbers], dtype=torch.float64)
    percent = torch.tensor([n.percent for f in facts for n in f.numbers], dtype=torch.bool)
    k = counts[a]
    pair = torch.repeat_interleave(torch.arange(len(a)), k)
    j = torch.arange(int(k.sum())) - torch.repeat_interleave(torch.cumsum(k, 0) - k, k)
    ia, ib = start[a][pair] + j, start[b][pair] + j
    x, y, px, py = values[ia], values[ib], percent[ia], percent[ib]

    def close(u: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return (u - v).abs() <= torch.clamp(rel_tol * torch.maximum(u.abs(), v.abs()), min=abs_tol)

    # a lone percentage may be read as its number or as its fraction
    ok = close(x, y) | ((px != py) & close(torch.where(px, x / 100, x), torch.where(py, y / 100, y)))
    return torch.zeros(len(a), dtype=torch.long).index_add_(0, pair, (~ok).long()) == 0


def facts_agree(a: Facts, b: Facts, rel_tol: float, abs_tol: float) -> bool:
    """Whether two steps state the same facts: the same skeleton and, in order, matching numbers."""
    import torch

    if a == b:
        return True
    if a.skeleton != b.skeleton:
        return False
    return bool(numbers_agree([a, b], torch.tensor([0]), torch.tensor([1]), rel_tol, abs_tol)[0])


def gate_blocks(
    pred_text: torch.Tensor, ref_text: torch.Tensor, steps: Sequence[str], rel_tol: float, abs_tol: float
) -> torch.Tensor:
    """Which (predicted, reference) step pairs may match: ``[C, U, M]`` bool for ``[C, U]`` and
    ``[C, M]`` indices into ``steps`` (padding: any value, its entries are not read).

    Equal facts agree (compared by id, all pairs at once); pairs with the same skeleton but other
    numbers go through :func:`numbers_agree`, once per distinct pair of facts, all at once.
    """
    import torch

    fact_ids: dict[Facts, int] = {}
    skeleton_ids: dict[tuple[str, ...], int] = {}
    facts = [step_facts(s) for s in steps]
    fid = torch.tensor([fact_ids.setdefault(f, len(fact_ids)) for f in facts] or [0], dtype=torch.long)
    sid = torch.tensor(
        [skeleton_ids.setdefault(f.skeleton, len(skeleton_ids)) for f in facts] or [0], dtype=torch.long
    )
    pick = lambda ids, idx: ids.to(idx.device)[idx.clamp(min=0)]
    fp, fr = pick(fid, pred_text).unsqueeze(2), pick(fid, ref_text).unsqueeze(1)
    agree = fp == fr
    near = (pick(sid, pred_text).unsqueeze(2) == pick(sid, ref_text).unsqueeze(1)) & ~agree
    if bool(near.any()):
        n = len(fact_ids)
        pairs, where = torch.unique((fp * n + fr)[near].cpu(), return_inverse=True)
        verdict = numbers_agree(list(fact_ids), pairs // n, pairs % n, rel_tol, abs_tol)
        agree[near] = verdict.to(agree.device)[where.to(agree.device)]
    return agree

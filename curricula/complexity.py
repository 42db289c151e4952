"""Complexity tiers of CRYSTAL's supplementary S3 (docs/method.md section 11).

    c = 0.4 s_steps + 0.2 s_length + 0.2 s_ling + 0.2 s_type,
    easy: c < 0.27, medium: 0.27 <= c < 0.42, hard: c >= 0.42.

The paper names the ingredients of each sub-score but not their normalisation; ours (each
sub-score in [0, 1], every constant in ``ComplexityConfig``) and why: docs/method.md section 11.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

Tier = Literal["easy", "medium", "hard"]
TIERS: tuple[Tier, ...] = ("easy", "medium", "hard")
WEIGHTS = {"steps": 0.4, "length": 0.2, "ling": 0.2, "type": 0.2}
EASY_BELOW = 0.27
MEDIUM_BELOW = 0.42


def _words(*phrases: str) -> re.Pattern[str]:
    alternatives = "|".join(r"\s+".join(map(re.escape, p.split())) for p in phrases)
    return re.compile(rf"\b(?:{alternatives})\b", re.IGNORECASE)


LING_MARKERS: dict[str, re.Pattern[str]] = {
    "conditional": _words(
        "if",
        "when",
        "whenever",
        "unless",
        "whether",
        "suppose",
        "supposing",
        "assume",
        "assuming",
        "otherwise",
        "in case",
    ),
    "causal": _words(
        "because",
        "therefore",
        "thus",
        "hence",
        "since",
        "so that",
        "due to",
        "cause",
        "causes",
        "caused",
        "consequently",
        "as a result",
        "leads to",
        "lead to",
        "result in",
        "results in",
    ),
    "comparison": _words(
        "than",
        "more",
        "less",
        "most",
        "least",
        "compare",
        "compared",
        "comparison",
        "same",
        "different",
        "difference",
        "similar",
        "versus",
        "vs",
        "larger",
        "largest",
        "smaller",
        "smallest",
        "greater",
        "greatest",
        "higher",
        "highest",
        "lower",
        "lowest",
        "bigger",
        "biggest",
        "fewer",
        "fewest",
        "longer",
        "longest",
        "shorter",
        "shortest",
        "older",
        "oldest",
        "younger",
        "youngest",
        "farther",
        "farthest",
        "closer",
        "closest",
        "better",
        "best",
        "worse",
        "worst",
        "heavier",
        "heaviest",
        "lighter",
        "lightest",
        "faster",
        "fastest",
        "slower",
        "slowest",
        "warmer",
        "warmest",
        "colder",
        "coldest",
        "hotter",
        "hottest",
    ),
    "negation": re.compile(
        r"\b(?:not|never|none|nor|neither|nothing|nobody|without|except|cannot)\b"
        r"|n['’]t\b",
        re.IGNORECASE,
    ),
}
COUNTING = re.compile(r"\bhow\s+many\b|\bcount\b|\bnumber\s+of\b", re.IGNORECASE)
WHY = re.compile(r"\bwhy\b", re.IGNORECASE)
_YES_NO = {"yes", "no", "true", "false"}
_LETTER = re.compile(r"^\(?[A-Z]\)?[.:]?$|^option\s+[a-z]$", re.IGNORECASE)
_NUMBER = re.compile(r"^[-+]?[$€£]?(?:\d[\d,]*(?:\.\d+)?|\.\d+)\s*(?:%|[a-z]+)?$", re.IGNORECASE)

AnswerType = Literal["yes_no", "letter", "number", "text"]


@dataclass(frozen=True)
class ComplexityConfig:
    """Normalisation constants (why these values: docs/method.md section 11)."""

    step_cap: int = 30
    char_cap: int = 300
    word_cap: int = 50
    type_base: Mapping[str, float] = field(
        default_factory=lambda: {"yes_no": 0.2, "letter": 0.3, "number": 0.4, "text": 0.5}
    )
    counting_adjust: float = -0.15
    why_adjust: float = 0.20


DEFAULT_CONFIG = ComplexityConfig()


def _clip01(x: float) -> float:
    return min(1.0, max(0.0, x))


def step_count(example: Mapping[str, Any]) -> int:
    """Reference step count. With ``reference_sets`` (alternative chains) present and
    non-empty, the MEAN length of those chains rounded half up, so one terse or verbose
    annotator does not decide the tier; otherwise ``len(reference_steps)``."""
    sets = [s for s in (example.get("reference_sets") or []) if s is not None]
    if sets:
        return int(math.floor(sum(len(s) for s in sets) / len(sets) + 0.5))
    return len(example.get("reference_steps") or [])


def question_text(example: Mapping[str, Any]) -> str:
    """The question: ``question`` if present, else the last user turn of a
    conversational ``prompt`` (as built by train/data/splits.py) without its "Options:" tail."""
    q = example.get("question")
    if isinstance(q, str):
        return q.strip()
    prompt = example.get("prompt")
    if isinstance(prompt, str):
        return prompt.split("\nOptions:")[0].strip()
    for turn in reversed(prompt or []):
        if isinstance(turn, Mapping) and turn.get("role") == "user":
            content = turn.get("content")
            if isinstance(content, list):
                content = " ".join(
                    p.get("text") or "" for p in content if isinstance(p, Mapping) and p.get("type") == "text"
                )
            return str(content or "").split("\nOptions:")[0].strip()
    return ""


def answer_type(example: Mapping[str, Any]) -> AnswerType:
    """yes/no, option letter (or any answer to a question with ``choices``), number, text."""
    ans = example.get("answer")
    if isinstance(ans, bool):
        return "yes_no"
    if isinstance(ans, (int, float)):
        return "number"
    a = str(ans or "").strip()
    if a.lower().strip(".!") in _YES_NO:
        return "yes_no"
    if example.get("choices") or _LETTER.match(a):
        return "letter"
    if _NUMBER.match(a):
        return "number"
    return "text"


def complexity_components(example: Mapping[str, Any], config: ComplexityConfig = DEFAULT_CONFIG) -> dict[str, float]:
    """The four sub-scores of Eq. S1, each in [0, 1]."""
    q = question_text(example)
    s_steps = min(step_count(example), config.step_cap) / config.step_cap
    s_length = 0.5 * min(1.0, len(q) / config.char_cap) + 0.5 * min(1.0, len(q.split()) / config.word_cap)
    s_ling = sum(bool(p.search(q)) for p in LING_MARKERS.values()) / len(LING_MARKERS)
    s_type = config.type_base[answer_type(example)]
    if COUNTING.search(q):
        s_type += config.counting_adjust
    if WHY.search(q):
        s_type += config.why_adjust
    return {"steps": s_steps, "length": s_length, "ling": s_ling, "type": _clip01(s_type)}


def complexity_score(example: Mapping[str, Any], config: ComplexityConfig = DEFAULT_CONFIG) -> float:
    """c of Eq. S1, in [0, 1]."""
    parts = complexity_components(example, config)
    return sum(WEIGHTS[k] * v for k, v in parts.items())


def tier_of(c: float) -> Tier:
    """Tier of a complexity score (S3 thresholds)."""
    return "easy" if c < EASY_BELOW else "medium" if c < MEDIUM_BELOW else "hard"


def complexity_tier(example: Mapping[str, Any], config: ComplexityConfig = DEFAULT_CONFIG) -> Tier:
    return tier_of(complexity_score(example, config))


def rows(
    dataset: Any,
    columns: Sequence[str] = ("question", "prompt", "answer", "choices", "reference_steps", "reference_sets"),
) -> list[dict]:
    """Rows as dicts with only the columns complexity needs. For a ``datasets.Dataset``
    this reads whole columns, so image transforms (train/data/splits.py) never run."""
    names = getattr(dataset, "column_names", None)
    if names is None:
        return [dict(r) for r in dataset]
    present = [c for c in columns if c in names]
    if not present:
        return [{} for _ in range(len(dataset))]
    cols = dataset.select_columns(present).with_format(None)[:]
    return [{c: cols[c][i] for c in present} for i in range(len(dataset))]


def annotate(
    examples: Iterable[Mapping[str, Any]], config: ComplexityConfig = DEFAULT_CONFIG
) -> tuple[list[int], list[float], list[Tier]]:
    """Step counts, complexity scores and tiers of many examples (for samplers and logs)."""
    steps, scores, tiers = [], [], []
    for ex in examples:
        c = complexity_score(ex, config)
        steps.append(step_count(ex))
        scores.append(c)
        tiers.append(tier_of(c))
    return steps, scores, tiers

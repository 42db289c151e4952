"""Answer correctness C (docs/method.md section 5): type-adapted comparison of two answers.

Ground-truth answers are numbers, option letters, yes/no, words or phrases, and the policy
writes them in many surface forms ("$12", "12 sheep", "(B) 12", "Yes."). The checks run in
order, the first that applies deciding: option letters, yes/no, numbers within a tolerance,
normalised exact match, then an optional judge for free-form answers only (docs/method.md
section 5 lists each rule). Every pattern runs in linear time on output of any length, and
over-long predictions are refused (``MAX_ANSWER_CHARS``).
"""

from __future__ import annotations

import math
import re
import unicodedata
from collections.abc import Callable, Sequence
from typing import NamedTuple

Judge = Callable[[str, str], bool]

#: A predicted answer longer than this (and than twice the truth) never matches. Truths
#: are short (a number, a letter, yes/no, a word or phrase), so such a prediction is a
#: paragraph, not an answer; the cap keeps one call's work small whatever the model
#: writes and keeps walls of text away from the judge. It can only lower a reward.
MAX_ANSWER_CHARS = 1_000

_default_judge: Judge | None = None


def set_default_judge(fn: Judge | None) -> None:
    """Install (or, with None, remove) the judge used by calls that pass no ``judge``."""
    global _default_judge
    _default_judge = fn


# --- normalisation helpers ---------------------------------------------------------

#: Typographic quotes, unicode minus and dashes, and the fraction slash as ASCII (the step gate reads
#: steps with it too: rewards/facts.py).
PLAIN_PUNCTUATION = str.maketrans(
    {
        "\u2018": "'",
        "\u2019": "'",
        "\u201a": "'",
        "\u201b": "'",
        "\u201c": '"',
        "\u201d": '"',
        "\u201e": '"',
        "\u201f": '"',
        "\u2212": "-",
        "\u2012": "-",
        "\u2013": "-",
        "\ufe63": "-",
        "\u2044": "/",
    }
)  # also unicode minus/dashes and the fraction slash
_ARTICLES = {"a", "an", "the"}
_DIGIT_PUNCT = re.compile(r"(?<=\d)[^\w\s](?=\d)")


def _text(value: str | int | float | None) -> str:
    """The answer as stripped NFKC text (bools read yes/no); None, NaN, inf and other types read ''."""
    if isinstance(value, str):
        return unicodedata.normalize("NFKC", value).translate(PLAIN_PUNCTUATION).strip()
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return str(value) if math.isfinite(value) else ""
    if isinstance(value, int):  # math.isfinite would overflow past float range
        try:
            return str(value)
        except ValueError:  # beyond Python's 4,300-digit str() limit
            return ""
    return ""


def _normalize(text: str) -> str:
    """Lowercase, drop punctuation and articles, collapse whitespace (SQuAD-style).

    Punctuation between two digits becomes a space instead, so "1-2" never reads "12".
    """
    text = _DIGIT_PUNCT.sub(" ", text.lower())
    text = "".join(ch for ch in text if not unicodedata.category(ch).startswith("P"))
    return " ".join(w for w in text.split() if w not in _ARTICLES)


def _yes_no(text: str) -> bool | None:
    norm = _normalize(text)
    return True if norm in ("yes", "true") else False if norm in ("no", "false") else None


# --- numbers -----------------------------------------------------------------------


class Number(NamedTuple):
    """A number as written: its value (NaN when it does not fit a float) and whether it is a percentage."""

    value: float
    percent: bool


_CUR = r"(?:[$€£¥₹]\s*)?"
#: The surface forms of a number shared with the step gate (rewards/facts.py): the digits
#: (1,234.5 | 12.5 | .5), an exponent (1e5) and a percent sign or word after it.
DIGITS = r"(\d{1,3}(?:,\d{3})+(?:\.\d+)?|\d+(?:\.\d+)?|\.\d+)(?!\d)"
EXPONENT = r"(?:[eE]([-+]?\d+))?"
PERCENT = r"(\s*(?:%|percent\b|per\s+cent\b))?"
# Written to run in linear time on any text. The lookahead stops a match from starting
# inside a whitespace run (it could: every piece before the digits is optional), and
# the whitespace after a sign belongs to the sign's group, so it cannot trade characters
# with the currency sign's whitespace (docs/rewards.md, "Hostile model output").
_NUMBER = re.compile(
    r"(?<![\w.])(?=[-+$€£¥₹.\d])"
    + _CUR
    + r"(?:([-+])\s*)?"
    + _CUR
    + DIGITS
    + r"(?:\s*/\s*(\d+(?:\.\d+)?))?"  # fraction 1/2
    + EXPONENT
    + PERCENT,
    re.IGNORECASE,
)


def _numbers(text: str, limit: int = 2) -> list[Number]:
    """Up to ``limit`` numbers found in the text (enough to tell none / one / several)."""
    found = []
    for m in _NUMBER.finditer(text):
        sign, body, denom, exp, pct = m.groups()
        value = float(body.replace(",", ""))
        if denom is not None:
            value = value / float(denom) if float(denom) else math.nan
        if exp:
            value *= float("1e" + exp)  # overflows to inf (then rejected), never raises
        if sign == "-":
            value = -value
        found.append(Number(value if math.isfinite(value) else math.nan, bool(pct)))
        if len(found) >= limit:
            break
    return found


def _one_number(text: str) -> Number | None:
    nums = _numbers(text)
    return nums[0] if len(nums) == 1 and math.isfinite(nums[0].value) else None


def _close(a: float, b: float, rel_tol: float, abs_tol: float) -> bool:
    return abs(a - b) <= max(rel_tol * max(abs(a), abs(b)), abs_tol)


def numbers_match(p: Number, t: Number, rel_tol: float, abs_tol: float) -> bool:
    """Compare with tolerance; a lone percentage may be read as its number or its fraction."""
    if p.percent == t.percent:
        return _close(p.value, t.value, rel_tol, abs_tol)
    pct, other = (p, t) if p.percent else (t, p)
    return any(_close(v, other.value, rel_tol, abs_tol) for v in (pct.value, pct.value / 100))


# --- option letters ----------------------------------------------------------------

# One letter inside any run of opening / closing wrappers: brackets, quotes, Markdown
# emphasis and code, then an optional full stop, colon or "!" (itself possibly wrapped,
# "**B.**"). Typographic quotes and full-width brackets arrive here already straightened
# by _text (NFKC + PLAIN_PUNCTUATION). The second closing run sits inside the optional group so
# the two runs can never trade characters (that backtracks quadratically).
_OPEN = "[\\[({<\"'`*_「【〈《『〔«‹]*"
_CLOSE = "[\\])}>\"'`*_」】〉》』〕»›]*"
_WRAPPED = _OPEN + "([A-Za-z])" + _CLOSE + "(?:[.:!]" + _CLOSE + ")?"
_BARE_LETTER = re.compile("^" + _WRAPPED + "$")
# "(?:\s*:)?\s*" rather than "\s*:?\s*": two whitespace runs that can trade characters
# backtrack quadratically on a long run of spaces.
_PHRASE_LETTER = re.compile(
    r"^(?:the\s+)?(?:correct\s+|final\s+)?(?:answer|option|choice)"
    r"(?:\s+is)?(?:\s*:)?\s*" + _WRAPPED + "$",
    re.IGNORECASE,
)
_PREFIX_LETTER = re.compile(r"^(?:\(([A-Za-z])\)\s*|([A-Z])[.)]\s+)\S")


def _bare_letter(text: str) -> str | None:
    m = _BARE_LETTER.match(text)
    return m.group(1).upper() if m else None


def _read_letter(text: str) -> str | None:
    """The option letter a prediction names: "B", "(B)", "option B", "(B) 12", ..."""
    for pattern in (_BARE_LETTER, _PHRASE_LETTER, _PREFIX_LETTER):
        m = pattern.match(text)
        if m:
            return next(g for g in m.groups() if g).upper()
    return None


def _choice_letter(text: str, choices: Sequence[str]) -> str | None:
    """The letter of the option whose text this is: exact normalised text, else a unique number."""
    norm = _normalize(text)
    opts = [_text(c) if isinstance(c, (str, int, float)) else "" for c in choices]
    for i, opt in enumerate(opts[:26]):
        if norm and _normalize(opt) == norm:
            return chr(ord("A") + i)
    num = _one_number(text)
    if num is None:
        return None
    hits = [
        i
        for i, opt in enumerate(opts[:26])
        if (o := _one_number(opt)) is not None and numbers_match(num, o, 0.0, 1e-9)
    ]
    return chr(ord("A") + hits[0]) if len(hits) == 1 else None


# --- the comparison ----------------------------------------------------------------


def answers_match(
    predicted: str | int | float | None,
    truth: str | int | float | None,
    choices: Sequence[str] | None = None,
    *,
    rel_tol: float = 1e-2,
    abs_tol: float = 1e-6,
    judge: Judge | None = None,
) -> bool:
    """True when ``predicted`` gives the answer ``truth`` (docs/method.md section 5).

    An empty or missing answer on either side never matches. ``judge`` (or the default
    installed with ``set_default_judge``) is consulted only for free-form answers that
    did not match exactly; its exceptions propagate to the caller.
    """
    pred, gold = _text(predicted), _text(truth)
    if not pred or not gold or len(pred) > max(MAX_ANSWER_CHARS, 2 * len(gold)):
        return False
    choices = list(choices) if choices else None

    gold_letter = _bare_letter(gold)
    if gold_letter is None and choices:
        gold_letter = _choice_letter(gold, choices)
    if gold_letter is not None:
        pred_letter = _read_letter(pred) or (_choice_letter(pred, choices) if choices else None)
        if pred_letter is not None or _bare_letter(gold):
            return pred_letter == gold_letter

    gold_yn, pred_yn = _yes_no(gold), _yes_no(pred)
    if gold_yn is not None:
        return pred_yn == gold_yn

    gold_num, pred_nums = _one_number(gold), _numbers(pred)
    if gold_num is not None:
        if len(pred_nums) == 1 and math.isfinite(pred_nums[0].value):
            return numbers_match(pred_nums[0], gold_num, rel_tol, abs_tol)
        if not pred_nums:
            return False

    norm_pred, norm_gold = _normalize(pred), _normalize(gold)
    if norm_pred and norm_pred == norm_gold:
        return True

    free_form = (
        gold_letter is None
        and gold_num is None
        and pred_yn is None
        and _bare_letter(pred) is None
        and _one_number(pred) is None
    )
    judge = judge if judge is not None else _default_judge
    return bool(free_form and judge is not None and judge(pred, gold))

"""Step credit: each predicted step's own score from the Match F1 scorer's alignment (docs/method.md
section 6, "Step credit").

A reward gives one number per completion, so every token of it shares one advantage; the scorer
already knows which predicted step matched which reference step. Here each step gets +1 when the
matcher paired it 1:1 with a reference step and -1 when it is unmatched, repeats an earlier step of
its completion, or restates the prompt (a copied hint stays negative even where a sentence encoder
matches it); the scores are centred and scaled within each group (one prompt's completions), and
each step's characters are located in the completion text, for the trainer to credit its tokens
(train/trainer/step_credit.py). Pure functions of the one evaluation (:class:`Scored`): nothing
here scores a second time.
"""

from __future__ import annotations

import json
import re
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from crystal_grpo.rewards.encoder import normalize_step
from crystal_grpo.rewards.parsing import clean_steps, locate_object
from crystal_grpo.typed import option

if TYPE_CHECKING:
    import torch

    from crystal_grpo.rewards.batch import Scored

#: A step the matcher paired with a reference step, and one it did not (or a repeat, or a restatement).
MATCHED, UNMATCHED = 1.0, -1.0
#: TRL's epsilon in ``(r - mean) / (std + eps)``: the step term is scaled as the outcome is.
EPS = 1e-4

_DECODER = json.JSONDecoder()
_WS = re.compile(r"[ \t\n\r]*")


@dataclass
class StepCreditConfig:
    """``reward.step_credit``: per-token advantages from the matched steps (off at weight 0)."""

    weight: float = option(
        0.0,
        "W: each step's tokens get the sequence's advantage plus W x the step's group-normalised score "
        "(+1 matched, -1 unmatched, repeated or restating the prompt; docs/method.md); 0: off.",
        ge=0,
    )

    @property
    def on(self) -> bool:
        return self.weight > 0


# ----------------------------------------------------------------------------- scores
def restates(step: str, prompt: str) -> bool:
    """Whether normalised ``step`` occurs in normalised ``prompt`` as whole words (``normalize_step``)."""
    if not step:
        return False
    at = prompt.find(step)
    while at >= 0:
        end = at + len(step)
        if (at == 0 or not prompt[at - 1].isalnum()) and (end == len(prompt) or not prompt[end].isalnum()):
            return True
        at = prompt.find(step, at + 1)
    return False


def step_scores(steps: Sequence[str], matched: Collection[int], prompt: str) -> list[float]:
    """Each step's raw score: :data:`MATCHED` when its index is in ``matched`` (the scorer's accepted
    pairs), unless it repeats an earlier step or restates ``prompt`` (normalised text); else
    :data:`UNMATCHED`."""
    return _scores(steps, matched, normalize_step(prompt))


def _scores(steps: Sequence[str], matched: Collection[int], prompt: str) -> list[float]:
    seen, out = set(), []
    for j, step in enumerate(steps):
        norm = normalize_step(step)
        good = j in matched and norm not in seen and not restates(norm, prompt)
        seen.add(norm)
        out.append(MATCHED if good else UNMATCHED)
    return out


def scored_step_scores(scored: Scored, prompts: Sequence[str]) -> list[list[float] | None]:
    """:func:`step_scores` of every completion of one evaluation (``prompts``: each one's
    ``prompt_text``); None for a row whose steps were not scored (no references, or not asked)."""
    index = {row: n for n, row in enumerate(scored.step_rows)}
    normal: dict[str, str] = {}  # a group's completions share one prompt: normalised once
    out: list[list[float] | None] = []
    for i, parsed in enumerate(scored.parsed):
        n = index.get(i)
        if n is None or scored.steps is None:
            out.append(None)
            continue
        if prompts[i] not in normal:
            normal[prompts[i]] = normalize_step(prompts[i])
        out.append(_scores(parsed.steps, set(scored.steps.pairs[n][:, 0].tolist()), normal[prompts[i]]))
    return out


def moments(scores: Sequence[Sequence[float] | None]) -> torch.Tensor:
    """``[N, 3]`` float64: each row's step count, sum and sum of squares (zeros for None)."""
    import torch

    return torch.tensor(
        [[len(s), sum(s), sum(x * x for x in s)] if s else [0, 0, 0] for s in scores], dtype=torch.float64
    ).reshape(-1, 3)


def credit_scale(
    moments_: torch.Tensor, groups: torch.Tensor, scale_rewards: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """(each row's group mean of the step scores, the factor its centred scores are multiplied by).

    ``moments_``: :func:`moments` of every row of the batch; ``groups``: ``[N]`` each row's group.
    The scores are pooled over all steps of a group's completions; the factor is ``1 / (std + eps)``
    with the group's std (``scale_rewards`` group), the batch's (batch) or 1 (none), as TRL scales
    the outcome. A group whose scores do not vary (all alike, or one step) is its mean at every step:
    its centred scores are exactly 0 (sums of +-1 are exact).
    """
    import torch

    scale_rewards = {True: "group", False: "none"}.get(scale_rewards, scale_rewards)  # as GRPOConfig reads it
    if scale_rewards not in ("group", "batch", "none"):
        raise ValueError(f"scale_rewards={scale_rewards!r}: expected 'group', 'batch' or 'none'")
    m = moments_.double()
    sums = torch.zeros(int(groups.max()) + 1 if len(groups) else 0, 3, dtype=torch.float64)
    sums.index_add_(0, groups, m)

    def mean_std(n: torch.Tensor, s: torch.Tensor, q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        mean = s / n.clamp(min=1)
        var = (q - n * mean * mean) / (n - 1).clamp(min=1)  # Bessel-corrected, as TRL's nanstd
        return mean, torch.where(n >= 2, var.clamp(min=0).sqrt(), torch.zeros_like(var))

    mean, std = mean_std(*sums.unbind(1))
    if scale_rewards == "batch":
        std = mean_std(*m.sum(dim=0).unbind(0))[1].expand_as(std)
    factor = 1.0 / (std + EPS) if scale_rewards != "none" else torch.ones_like(std)
    return mean[groups], factor[groups]


def step_terms(
    scores: Sequence[Sequence[float] | None], mean: torch.Tensor, factor: torch.Tensor
) -> list[list[float] | None]:
    """Each step's normalised score ``(s - group mean) x factor`` (:func:`credit_scale`)."""
    return [None if s is None else [(x - float(mu)) * float(f) for x in s] for s, mu, f in zip(scores, mean, factor)]


# ----------------------------------------------------------------------------- where each step is
def step_char_spans(text: str, steps: Sequence[str]) -> list[tuple[int, int]] | None:
    """Each step's characters ``[start, end)`` in the completion ``text``, for the steps
    ``parse_completion(text)`` reads (``steps``), in their order: inside the quotes of its JSON
    string (escapes and all, as written), or its number. The k-th step is the k-th kept element of
    the ``reasoning_steps`` array that object holds (its last, as JSON reads duplicate keys), so a
    repeated text maps to its own place. None when they cannot be found (the text is not what was
    parsed); ``[]`` without steps."""
    if not steps:
        return []
    try:
        obj, start, _ = locate_object(text)
        items = _array_items(text, start) if obj is not None else None
    except (ValueError, RecursionError):  # the object decoded, so only junk parse_completion survives
        return None
    if items is None:
        return None
    spans, kept = [], []
    for a, b, value in items:
        cleaned = clean_steps([value])
        if not cleaned:
            continue
        kept += cleaned
        if isinstance(value, str):
            a, b = a + 1, b - 1  # inside the quotes
            while a < b and text[a] == " ":
                a += 1
            while b > a and text[b - 1] == " ":
                b -= 1
        spans.append((a, b))
    return spans if kept == list(steps) else None


def _skip(text: str, i: int) -> int:
    return _WS.match(text, i).end()


def _array_items(text: str, start: int) -> list[tuple[int, int, Any]] | None:
    """``(start, end, value)`` of each element of the ``reasoning_steps`` array of the object at ``start``."""
    i, found = _skip(text, start + 1), None
    while not text.startswith("}", i):
        key, i = _DECODER.raw_decode(text, i)
        i = _skip(text, i)
        if not text.startswith(":", i):
            return None
        i = _skip(text, i + 1)
        value, end = _DECODER.raw_decode(text, i)
        if key == "reasoning_steps":
            found = i if isinstance(value, list) else None
        i = _skip(text, end)
        if text.startswith(",", i):
            i = _skip(text, i + 1)
        elif not text.startswith("}", i):
            return None
    if found is None:
        return None
    items, i = [], _skip(text, found + 1)
    while not text.startswith("]", i):
        value, end = _DECODER.raw_decode(text, i)
        items.append((i, end, value))
        i = _skip(text, end)
        if text.startswith(",", i):
            i = _skip(text, i + 1)
    return items

"""Step credit: per-token advantages from the matched steps (``reward.step_credit``; docs/method.md
section 6, "Step credit"; the steps' scores and places: rewards/step_credit.py).

TRL 1.16's ``_compute_loss`` takes ``(B, T)`` advantages. After the reward module's one evaluation,
:meth:`StepCredit.rows` scores each step, normalises the scores within groups over all processes and
finds each step's tokens in ``completion_ids``; :func:`credit_tensor` makes the batch field
``step_advantages`` (``(B, T)``: W x the step's term on its tokens, 0 elsewhere) that the trainer puts
beside TRL's ``advantages`` and adds to them in the loss. Kept apart until the loss because the term is
the reasoning objective's alone (PCGrad, train/pcgrad/trainer.py) and dynamic sampling zeroes and pads
it (train/trainer/dynamic_sampling.py). A completion whose steps cannot be found keeps its sequence
advantage and is counted (``step_credit/fallback_rate``).
"""

from __future__ import annotations

import os
import time
from bisect import bisect_left, bisect_right
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from tokenizers.decoders import DecodeStream

from crystal_grpo.rewards.batch import Scored
from crystal_grpo.rewards.parsing import prompt_text
from crystal_grpo.rewards.step_credit import (
    credit_scale,
    moments,
    scored_step_scores,
    step_char_spans,
    step_terms,
)

#: The batch field of the per-token step term (``(B, T)``, float32).
STEP_FIELD = "step_advantages"
#: One completion's credit: each step's token range ``[t0, t1)`` and its term.
RowCredit = list[tuple[tuple[int, int], float]]


def token_ends(tokenizer: Any, ids: Sequence[int]) -> tuple[str, list[int]]:
    """The text ``ids`` decode to (special tokens skipped) and, for each token, where the characters
    decoded up to it end: a fast tokenizer's incremental decoder (a multi-byte character split over
    tokens ends at the token that completes it), else every prefix decoded (quadratic). Re-encoding
    the text need not give ``ids`` back, so the text is read off the ids."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        stream, parts, ends, n = DecodeStream(skip_special_tokens=True), [], [], 0
        for i in ids:
            chunk = stream.step(backend, int(i))
            if chunk:
                parts.append(chunk)
                n += len(chunk)
            ends.append(n)
        return "".join(parts), ends
    text = tokenizer.decode(list(ids), skip_special_tokens=True)
    ends, n = [], 0
    for k in range(1, len(ids) + 1):
        n = max(n, len(os.path.commonprefix([tokenizer.decode(list(ids[:k]), skip_special_tokens=True), text])))
        ends.append(n)
    return text, ends


def token_spans(char_spans: Sequence[tuple[int, int]], ends: Sequence[int]) -> list[tuple[int, int]]:
    """Each character span's tokens ``[t0, t1)``: those whose characters overlap it. A token that
    completes no character (the first bytes of a multi-byte one) goes with the token that does."""
    starts = [0, *ends[:-1]]
    reach = list(ends)
    for t in range(len(ends) - 2, -1, -1):
        if ends[t] == starts[t]:
            reach[t] = reach[t + 1]
    return [(bisect_right(reach, a), bisect_left(starts, b)) for a, b in char_spans]


def row_credit(tokenizer: Any, ids: Sequence[int], steps: Sequence[str], terms: Sequence[float]) -> RowCredit | None:
    """One completion's credit: each step's token range and its term; None when its steps cannot be
    found in the text its ids decode to."""
    text, ends = token_ends(tokenizer, ids)
    chars = step_char_spans(text, steps)
    return None if chars is None else list(zip(token_spans(chars, ends), terms))


def credit_metrics(rows: Sequence[RowCredit | None], tokens: int) -> dict[str, float]:
    """What a batch's credit logs (``step_credit/<name>``, beside the hook's ``seconds``): the share of
    completions with steps whose steps were not found (``rows``: ``[]`` nothing to credit, None not
    found), of the ``tokens`` inside steps, and the mean term (and its magnitude) over those tokens."""
    tried = [r for r in rows if r != []]
    spans = [(t1 - t0, term) for row in tried if row for (t0, t1), term in row]
    inside = sum(n for n, _ in spans)
    out = {"fallback_rate": sum(r is None for r in tried) / len(tried)} if tried else {}
    if tokens:
        out["token_share"] = inside / tokens
    if inside:
        out["term_mean"] = sum(n * term for n, term in spans) / inside
        out["term_abs_mean"] = sum(n * abs(term) for n, term in spans) / inside
    return out


def credit_tensor(rows: Sequence[RowCredit | None], width: int) -> torch.Tensor:
    """``(len(rows), width)`` float32: each step's term on its tokens, 0 elsewhere (a token two steps
    share takes the later one's)."""
    out = torch.zeros(len(rows), width)
    for i, row in enumerate(rows):
        for (t0, t1), term in row or ():
            out[i, t0:t1] = term
    return out


def with_step_term(advantages: torch.Tensor, step: torch.Tensor | None) -> torch.Tensor:
    """``advantages`` (``(B,)`` or ``(B, T)``) plus the per-token step term (``(B, T)``), or as they are."""
    if step is None:
        return advantages
    return (advantages.unsqueeze(1) if advantages.dim() == 1 else advantages) + step


@dataclass
class StepCredit:
    """The credit of one generation round's steps (module docstring). ``weight``: W; ``tokenizer``
    reads each completion's ids; ``accelerator`` gathers the step statistics of every process."""

    weight: float
    tokenizer: Any
    accelerator: Any
    scale_rewards: Any

    def rows(
        self, scored: Scored, prompts: list, completion_ids: list, group_size: int
    ) -> tuple[list[RowCredit | None], dict[str, float]]:
        """This process's completions' credit (W included; the group statistics over all processes'
        steps, in groups of ``group_size``), and what it logs (``step_credit/<name>``)."""
        start = time.perf_counter()
        scores = scored_step_scores(scored, [prompt_text(p) for p in prompts])
        n, rank = len(scores), self.accelerator.process_index
        everyone = self.accelerator.gather(moments(scores).to(self.accelerator.device)).cpu()
        mean, factor = credit_scale(everyone, torch.arange(len(everyone)) // group_size, self.scale_rewards)
        terms = step_terms(scores, mean[rank * n : (rank + 1) * n], self.weight * factor[rank * n : (rank + 1) * n])
        rows = [
            row_credit(self.tokenizer, ids, parsed.steps, t) if t else []
            for parsed, ids, t in zip(scored.parsed, completion_ids, terms)
        ]
        metrics = credit_metrics(rows, sum(map(len, completion_ids)))
        metrics["seconds"] = time.perf_counter() - start
        return rows, metrics

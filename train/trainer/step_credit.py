"""Step credit in the trainer: per-token advantages from the matched steps (``reward.step_credit``;
docs/method.md section 6, "Step credit"; the steps' scores and places: rewards/step_credit.py).

TRL 1.16's ``_compute_loss`` takes ``(B, T)`` advantages. After the reward module's one evaluation,
``_calculate_rewards`` scores each step, normalises the scores within groups over all processes and
finds each step's tokens in ``completion_ids``; ``_generate_and_score_completions`` puts the batch
field ``step_advantages`` (``(B, T)``: W x the step's term on its tokens, 0 elsewhere) beside TRL's
``advantages``; ``_compute_loss`` adds the two. Kept apart until the loss because the term is the
reasoning objective's alone (PCGrad, train/pcgrad/trainer.py) and dynamic sampling zeroes and pads it
(train/trainer/dynamic_sampling.py). A completion whose steps cannot be found keeps its sequence
advantage and is counted (``step_credit/fallback_rate``).
"""

from __future__ import annotations

import os
import time
from bisect import bisect_left, bisect_right
from collections.abc import Sequence
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
from crystal_grpo.train.config.refusals import step_credit_refused

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


class StepCreditMixin:
    """The hooks of ``reward.step_credit`` for ``GRPOTrainer`` (module docstring). Before
    :class:`~crystal_grpo.train.trainer.reward_hooks.RewardModuleMixin` (it reads the evaluation
    that leaves) and dynamic sampling (whose loss scale then applies to the whole per-token advantage)."""

    _step_credit_rows: list[RowCredit | None] | None = None

    def setup_step_credit(self) -> None:
        """Check step credit against TRL's settings (after TRL's ``__init__``)."""
        if self.step_credit_weight:
            refused = step_credit_refused(self.importance_sampling_level, self.loss_type)
            if refused:
                raise ValueError(f"{refused[0]}: {refused[1]}")

    @property
    def step_credit_weight(self) -> float:
        """W of the reward module's step credit; 0: off (or no reward module)."""
        reward = getattr(self, "reward", None)
        return reward.step_credit.weight if reward is not None else 0.0

    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        rewards = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        if self.step_credit_weight:
            self._step_credit_rows = self._credit_rows(self.last_scored, prompts, completion_ids_list)
        return rewards

    def _credit_rows(self, scored: Scored, prompts: list, completion_ids: list) -> list[RowCredit | None]:
        """This process's completions' credit (W included); the group statistics over all processes' steps."""
        start = time.perf_counter()
        scores = scored_step_scores(scored, [prompt_text(p) for p in prompts])
        n, rank, weight = len(scores), self.accelerator.process_index, self.step_credit_weight
        everyone = self.accelerator.gather(moments(scores).to(self.accelerator.device)).cpu()
        size = self.num_generations if self.model.training else self.num_generations_eval
        mean, factor = credit_scale(everyone, torch.arange(len(everyone)) // size, self.scale_rewards)
        terms = step_terms(scores, mean[rank * n : (rank + 1) * n], weight * factor[rank * n : (rank + 1) * n])
        tokenizer = getattr(self.processing_class, "tokenizer", self.processing_class)
        rows = [
            row_credit(tokenizer, ids, parsed.steps, t) if t else []
            for parsed, ids, t in zip(scored.parsed, completion_ids, terms)
        ]
        metrics = credit_metrics(rows, sum(map(len, completion_ids)))
        metrics["seconds"] = time.perf_counter() - start
        for name, value in metrics.items():
            self._log_metric(f"step_credit/{name}", value)
        return rows

    def _generate_and_score_completions(self, inputs):
        out = super()._generate_and_score_completions(inputs)
        rows, self._step_credit_rows = self._step_credit_rows, None
        if rows is not None:
            ids = out["completion_ids"]
            out[STEP_FIELD] = credit_tensor(rows, ids.shape[1]).to(ids.device)
        return out

    def _compute_loss(self, model, inputs):
        """TRL's loss on ``advantages + step_advantages`` (``(B, T)``) when the batch has a step term."""
        step = inputs.get(STEP_FIELD)
        if step is None:
            return super()._compute_loss(model, inputs)
        adv = inputs["advantages"]
        return super()._compute_loss(
            model, {**inputs, "advantages": (adv.unsqueeze(1) if adv.dim() == 1 else adv) + step}
        )

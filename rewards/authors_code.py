"""The reward the CRYSTAL authors' released training code uses: NOT the paper's Eq. 7.

Their scripts score steps by *word overlap*, not with a sentence encoder, and gate the
reward additively on the answer: 0.6 + 0.4 F1 when the answer is correct, 0.4 x 0.3 x F1
otherwise (their plain-CPR weights; the paper reports 0.65/0.35 with Match F1). Offered
as an ablation arm so users can measure whether the encoder matters.

Step similarity is the word-overlap F1 (Dice) of the two steps' sets of lower-cased
words, and a pair matches at ``overlap_threshold`` or above; the matching itself is the
project's greedy 1:1 (``rewards.matching``). The exact overlap threshold of the released
code could not be checked from this repository's sources: 0.5 is this project's choice
and is a parameter. Match F1 with the encoder is still computed for validation and the
diagnostics (``batch.f1``); only the trained step score (``batch.step``) is lexical.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch

from crystal_grpo.rewards.base import MAX_SCORED_STEPS, Scored, _chains
from crystal_grpo.rewards.cpr import CPRConfig, CPRReward
from crystal_grpo.rewards.match_f1 import StepScores, _as_chains, best_per_example, match_similarities
from crystal_grpo.rewards.text import clean_text
from crystal_grpo.typed import option

_WORD = re.compile(r"\w+")


def words(step: str) -> frozenset[str]:
    return frozenset(_WORD.findall(clean_text(step).lower()))


def word_overlap(a: frozenset[str], b: frozenset[str]) -> float:
    """Dice coefficient = F1 of the shared words (precision over ``a``, recall over ``b``)."""
    return 2 * len(a & b) / (len(a) + len(b)) if a or b else 0.0


def overlap_scores(predicted: Sequence[Sequence[str]], references: Sequence[Any], threshold: float,
                   alpha: float = 0.3, matcher: Literal["greedy", "dp"] = "greedy") -> StepScores:
    """Match F1 with word overlap in place of cosine similarity (several chains: best wins)."""
    sims, n_pred, n_ref, row_example = [], [], [], []
    for i, (pred, refs) in enumerate(zip(predicted, references)):
        p = [words(s) for s in pred]
        for chain in _as_chains(refs):
            r = [words(s) for s in chain]
            sims.append(torch.tensor([[word_overlap(a, b) for b in r] for a in p], dtype=torch.float64)
                        .reshape(len(p), len(r)))
            n_pred.append(len(p))
            n_ref.append(len(r))
            row_example.append(i)
    N, M = max(n_pred, default=0), max(n_ref, default=0)
    sim = torch.full((len(sims), N, M), -1.0, dtype=torch.float64)
    for k, s in enumerate(sims):
        sim[k, :s.shape[0], :s.shape[1]] = s
    scores = match_similarities(sim, torch.tensor(n_pred, dtype=torch.long), torch.tensor(n_ref, dtype=torch.long),
                                threshold, alpha, matcher)
    return best_per_example(scores, torch.tensor(row_example, dtype=torch.long), len(predicted))


@dataclass
class AuthorsCodeConfig(CPRConfig):
    answer_weight: float = option(0.6, "Reward of a correct answer (their code: 0.6).", weight=True)
    step_weight: float = option(0.4, "Weight of the word-overlap F1 (their code: 0.4).", weight=True)
    wrong_answer_discount: float = option(0.3, "Share of the step reward kept when the answer is wrong.", weight=True)
    overlap_threshold: float = option(0.5, "Minimum word-overlap F1 for two steps to match.", ge=0, le=1)


class AuthorsCodeReward(CPRReward):
    """Gated-additive reward on word-overlap F1, as the authors' released code trains."""

    name = "authors_code"
    objectives = {"authors_code_accuracy": "accuracy", "authors_code_reasoning": "reasoning"}
    config_class = AuthorsCodeConfig
    config: AuthorsCodeConfig

    def score(self, completions: Sequence[Any], rows: Sequence[Mapping[str, Any]],
              with_steps: bool | None = None) -> Scored:
        scored = super().score(completions, rows, with_steps)
        if scored.step_rows:
            refs = [_chains(rows[i].get("reference_steps"), rows[i].get("reference_sets")) for i in scored.step_rows]
            steps = [scored.parsed[i].steps for i in scored.step_rows]
            steps = [s if len(s) <= MAX_SCORED_STEPS else [] for s in steps]
            cfg = self.config
            lexical = overlap_scores(steps, refs, cfg.overlap_threshold, cfg.order_alpha, cfg.matcher)
            scored.batch.step[scored.step_rows] = lexical.f1.double()
        return scored

    def components(self, batch) -> dict[str, torch.Tensor]:
        parts = super().components(batch)
        return {"authors_code_accuracy": parts["cpr_accuracy"], "authors_code_reasoning": parts["cpr_reasoning"]}

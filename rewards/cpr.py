"""The Causal Process Reward (paper Eq. 7 / S5).

R = a_w + s_w F1 when the answer is correct, s_w F1 lambda otherwise: reasoning quality
always counts, but a wrong answer discounts it, so good steps cannot hide a wrong
result. Split into two components that add up to Eq. 7 exactly:
R_acc = a_w C (accuracy) and R_reason = s_w F1 (C + lambda (1 - C)) (reasoning).
"""

from __future__ import annotations

import torch

from crystal_grpo.rewards.base import Batch, RewardModule


def cpr_reward(f1: torch.Tensor, correct: torch.Tensor, a_w: float = 0.65, s_w: float = 0.35,
               lam: float = 0.3) -> torch.Tensor:
    """Eq. 7 in one line, for readers and tests."""
    return torch.where(correct.bool(), a_w + s_w * f1, s_w * f1 * lam)


class CPRReward(RewardModule):
    """Defaults a_w = 0.65, s_w = 0.35, lambda = 0.3 (the paper's best weights; its
    public code used 0.6/0.4 for plain CPR)."""

    name = "cpr"
    objectives = {"cpr_accuracy": "accuracy", "cpr_reasoning": "reasoning"}

    def __init__(self, answer_weight: float = 0.65, step_weight: float = 0.35,
                 wrong_answer_discount: float = 0.3, **common) -> None:
        super().__init__(**common)
        self.a_w, self.s_w, self.lam = answer_weight, step_weight, wrong_answer_discount

    def components(self, batch: Batch) -> dict[str, torch.Tensor]:
        c = batch.correct
        return {
            "cpr_accuracy": self.a_w * c,
            "cpr_reasoning": self.s_w * batch.step * (c + self.lam * (1 - c)),
        }

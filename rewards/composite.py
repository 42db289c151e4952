"""The additive composite baseline (paper Eq. S4), the reward CPR replaces.

R = alpha (F1 - mu) / (sigma + delta) + beta C + gamma F, with mu and sigma the mean and
(population) std of F1 over the whole generation batch on all processes. The paper's
table of weights is not in the text; the defaults are this project's (SPEC section 6).
"""

from __future__ import annotations

import math

import torch

from crystal_grpo.rewards.base import Batch, RewardModule


class CompositeReward(RewardModule):
    name = "composite"
    objectives = {
        "composite_reasoning": "reasoning",
        "composite_accuracy": "accuracy",
        "composite_format": "accuracy",
    }

    def __init__(self, alpha: float = 0.35, beta: float = 0.65, gamma: float = 0.1,
                 delta: float = 1e-6, **common) -> None:
        super().__init__(**common)
        self.alpha, self.beta, self.gamma, self.delta = alpha, beta, gamma, delta

    def components(self, batch: Batch) -> dict[str, torch.Tensor]:
        f1 = batch.step
        known = f1[~torch.isnan(f1)]
        mu = known.mean() if len(known) else torch.tensor(math.nan, dtype=torch.float64)
        sigma = known.std(unbiased=False) if len(known) else mu
        return {
            "composite_reasoning": self.alpha * (f1 - mu) / (sigma + self.delta),
            "composite_accuracy": self.beta * batch.correct,
            "composite_format": self.gamma * batch.format_ok,
        }

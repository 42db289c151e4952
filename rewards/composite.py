"""The additive composite baseline (paper Eq. S4), the reward CPR replaces.

R = alpha (F1 - mu) / (sigma + delta) + beta C + gamma F, with mu and sigma the mean and
(population) std of F1 over the whole generation batch on all processes. The paper's
table of weights is not in the text; the defaults are this project's (docs/method.md section 6).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from crystal_grpo.rewards.base import Batch, RewardConfig, RewardModule
from crystal_grpo.typed import option

if TYPE_CHECKING:
    import torch


@dataclass
class CompositeConfig(RewardConfig):
    alpha: float = option(0.35, "Weight of the batch-normalised F1 term.", weight=True)
    beta: float = option(0.65, "Weight of answer correctness C.", weight=True)
    gamma: float = option(0.1, "Weight of the format indicator F.", weight=True)
    delta: float = option(1e-6, "Added to the batch std of F1 before dividing.", gt=0)


class CompositeReward(RewardModule):
    name = "composite"
    objectives = {
        "composite_reasoning": "reasoning",
        "composite_accuracy": "accuracy",
        "composite_format": "accuracy",
    }
    outcome_component = "composite_accuracy"
    config_class = CompositeConfig
    config: CompositeConfig

    def components(self, batch: Batch) -> dict[str, torch.Tensor]:
        cfg, f1 = self.config, batch.step
        known = f1[~f1.isnan()]
        mu = known.mean() if len(known) else f1.new_tensor(math.nan)
        sigma = known.std(unbiased=False) if len(known) else mu
        return {
            "composite_reasoning": cfg.alpha * (f1 - mu) / (sigma + cfg.delta),
            "composite_accuracy": cfg.beta * batch.correct,
            "composite_format": cfg.gamma * batch.format_ok,
        }

"""The Causal Process Reward (paper Eq. 7 / S5).

R = a_w + s_w F1 when the answer is correct, s_w F1 lambda otherwise: reasoning quality
always counts, but a wrong answer discounts it, so good steps cannot hide a wrong
result. Split into two components that add up to Eq. 7 exactly:
R_acc = a_w C (accuracy) and R_reason = s_w F1 (C + lambda (1 - C)) (reasoning).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from crystal_grpo.rewards.base import Batch, RewardConfig, RewardModule
from crystal_grpo.typed import option

if TYPE_CHECKING:
    import torch


def cpr_reward(
    f1: torch.Tensor, correct: torch.Tensor, a_w: float = 0.65, s_w: float = 0.35, lam: float = 0.3
) -> torch.Tensor:
    """Eq. 7 in one line, for readers and tests."""
    return (a_w + s_w * f1).where(correct.bool(), s_w * f1 * lam)


@dataclass
class CPRConfig(RewardConfig):
    """The paper's best weights (its public code used 0.6/0.4 for plain CPR)."""

    answer_weight: float = option(0.65, "a_w: reward of a correct answer.", weight=True)
    step_weight: float = option(0.35, "s_w: weight of the step score (Match F1).", weight=True)
    wrong_answer_discount: float = option(
        0.3, "lambda: share of the step reward kept when the answer is wrong.", weight=True
    )


class CPRReward(RewardModule):
    name = "cpr"
    objectives = {"cpr_accuracy": "accuracy", "cpr_reasoning": "reasoning"}
    outcome_component = "cpr_accuracy"
    config_class = CPRConfig
    config: CPRConfig

    def components(self, batch: Batch) -> dict[str, torch.Tensor]:
        c, cfg = batch.correct, self.config
        return {
            "cpr_accuracy": cfg.answer_weight * c,
            "cpr_reasoning": cfg.step_weight * batch.step * (c + cfg.wrong_answer_discount * (1 - c)),
        }

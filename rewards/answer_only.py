"""Format and answer-only rewards (SPEC section 6): the control, and CPR-Curriculum phase 1."""

from __future__ import annotations

import torch

from crystal_grpo.rewards.base import Batch, RewardModule


class FormatReward(RewardModule):
    """R = w_f F: 1 when the completion is the JSON object of SPEC section 2."""

    name = "format"
    objectives = {"format": "accuracy"}
    uses_steps = False

    def __init__(self, format_weight: float = 1.0, **common) -> None:
        super().__init__(**common)
        self.format_weight = format_weight

    def components(self, batch: Batch) -> dict[str, torch.Tensor]:
        return {"format": self.format_weight * batch.format_ok}


class AnswerOnlyReward(RewardModule):
    """R = w_a C + w_f F. Steps are not rewarded (but still scored for the diagnostics
    when ``score_steps`` is on, so an answer-only run shows how its reasoning drifts)."""

    name = "answer_only"
    objectives = {"answer_only_accuracy": "accuracy", "answer_only_format": "accuracy"}

    def __init__(self, accuracy_weight: float = 1.0, format_weight: float = 0.1,
                 score_steps: bool = True, **common) -> None:
        self.uses_steps = score_steps
        common.setdefault("verbosity_guard", False)
        super().__init__(**common)
        self.accuracy_weight, self.format_weight = accuracy_weight, format_weight

    def components(self, batch: Batch) -> dict[str, torch.Tensor]:
        return {
            "answer_only_accuracy": self.accuracy_weight * batch.correct,
            "answer_only_format": self.format_weight * batch.format_ok,
        }

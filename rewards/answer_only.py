"""Format and answer-only rewards (docs/method.md section 6): the control, and CPR-Curriculum phase 1."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Union

from crystal_grpo.rewards.base import Batch, RewardConfig, RewardModule
from crystal_grpo.typed import option

if TYPE_CHECKING:
    import torch


@dataclass
class FormatConfig(RewardConfig):
    format_weight: float = option(1.0, "w_f: reward of a completion in the JSON format.", weight=True)


class FormatReward(RewardModule):
    """R = w_f F: 1 when the completion is the JSON object of docs/method.md section 2."""

    name = "format"
    objectives = {"format": "accuracy"}
    uses_steps = False
    config_class = FormatConfig
    config: FormatConfig

    def components(self, batch: Batch) -> dict[str, torch.Tensor]:
        return {"format": self.config.format_weight * batch.format_ok}


@dataclass
class AnswerOnlyConfig(RewardConfig):
    accuracy_weight: float = option(1.0, "w_a: reward of a correct answer.", weight=True)
    format_weight: float = option(0.1, "w_f: reward of a completion in the JSON format.", weight=True)
    score_steps: bool = option(
        False,
        "Also score every training batch's steps for the training log's step diagnostics (not rewarded).",
    )
    verbosity_guard: Union[bool, None] = option(False, "Penalise over-long step lists (off: steps earn nothing).")


class AnswerOnlyReward(RewardModule):
    """R = w_a C + w_f F. Steps are not rewarded; validation still reports their Match F1, so an
    answer-only run shows how its reasoning drifts (``score_steps`` adds it to every training step)."""

    name = "answer_only"
    objectives = {"answer_only_accuracy": "accuracy", "answer_only_format": "accuracy"}
    outcome_component = "answer_only_accuracy"
    config_class = AnswerOnlyConfig
    config: AnswerOnlyConfig

    @property
    def uses_steps(self) -> bool:  # type: ignore[override]
        return self.config.score_steps

    def components(self, batch: Batch) -> dict[str, torch.Tensor]:
        return {
            "answer_only_accuracy": self.config.accuracy_weight * batch.correct,
            "answer_only_format": self.config.format_weight * batch.format_ok,
        }

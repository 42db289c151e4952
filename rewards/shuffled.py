"""A control arm: answer-only's rewards, shuffled across the generation batch.

Published RL results on small models show rewards unrelated to the completion (random or
spurious ones) still raising benchmark scores: GRPO's clipping and the sampling temperature
move a policy even without signal. An arm's gain therefore counts only where it beats this
control. Its rewards are a permutation of the batch's answer-only rewards, so their mean and
variance are exactly answer-only's, but which completion receives which reward has nothing
to do with the completion. The permutation is drawn from the batch's own content (and
``seed``), so a resumed run draws the same one.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import TYPE_CHECKING

from crystal_grpo.rewards.answer_only import AnswerOnlyConfig, AnswerOnlyReward
from crystal_grpo.rewards.base import Batch
from crystal_grpo.typed import option

if TYPE_CHECKING:
    import torch


@dataclass
class ShuffledConfig(AnswerOnlyConfig):
    seed: int = option(0, "Seed of the permutations (with each batch's content).", ge=0)


def permutation(batch: Batch, seed: int) -> torch.Tensor:
    """A random order of the batch's rows, a pure function of its content and ``seed``."""
    import torch

    content = torch.stack([batch.correct, batch.format_ok, batch.n_pred]).nan_to_num(-1.0).numpy().tobytes()
    gen = torch.Generator().manual_seed(zlib.crc32(content) ^ seed)
    return torch.randperm(len(batch), generator=gen)


class ShuffledAnswerReward(AnswerOnlyReward):
    """Answer-only's components, each permuted across the batch (the same permutation)."""

    name = "shuffled_answer"
    objectives = {"shuffled_accuracy": "accuracy", "shuffled_format": "accuracy"}
    outcome_component = "shuffled_accuracy"
    config_class = ShuffledConfig
    config: ShuffledConfig

    def outcome(self, batch: Batch) -> torch.Tensor:
        """The correctness the shuffled accuracy component pays: permuted like it."""
        rewarded = self.as_rewarded(batch)
        return rewarded.correct[permutation(rewarded, self.config.seed)]

    def components(self, batch: Batch) -> dict[str, torch.Tensor]:
        plain = super().components(batch)
        order = permutation(batch, self.config.seed)
        return {
            "shuffled_accuracy": plain["answer_only_accuracy"][order],
            "shuffled_format": plain["answer_only_format"][order],
        }

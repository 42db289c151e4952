"""``CrystalGRPOTrainer``: TRL's GRPOTrainer with the fewest hooks this project needs.

Each concept is a mixin in a module of its own, overriding the TRL / transformers hooks it needs
(every one listed in train/trainer/trl_seams.py): ``CrystalTrainerMixin`` is what every phase's
trainer adds (the non-finite guard, complete checkpoints and resume, Ctrl-C / SIGTERM, the model
card); ``CrystalGRPOTrainer`` adds the reward module (train/trainer/reward_hooks.py), the prompt
order (train/trainer/prompt_order.py), its step credit's per-token advantages
(train/trainer/step_credit.py), generation through merged LoRA adapters
(train/models/lora_merge.py), dynamic sampling (train/trainer/dynamic_sampling.py) and its own
``log`` (the KL maximum, the curriculum's record, GPU memory). PCGrad touches TRL internals, so
it lives in a subclass (train/pcgrad/trainer.py) that ``pcgrad.trainer_class`` picks only for
``pcgrad: true``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence, Sized
from typing import Any

import torch
from trl import GRPOTrainer

from crystal_grpo.rewards.base import RewardModule
from crystal_grpo.train.config.run_config import DynamicSamplingSection, ValidationSection
from crystal_grpo.train.models.lora_merge import MergedGenerationMixin
from crystal_grpo.train.run.model_card import ModelCardMixin
from crystal_grpo.train.trainer.callbacks import ValidationCallback
from crystal_grpo.train.trainer.checkpoint_hooks import CheckpointMixin
from crystal_grpo.train.trainer.dynamic_sampling import DynamicSamplingMixin
from crystal_grpo.train.trainer.interrupt import GracefulStopMixin
from crystal_grpo.train.trainer.nonfinite import NonFiniteGuardMixin
from crystal_grpo.train.trainer.prompt_order import PromptOrderMixin
from crystal_grpo.train.trainer.reward_hooks import RewardModuleMixin
from crystal_grpo.train.trainer.step_credit import StepCreditMixin


class CrystalTrainerMixin(NonFiniteGuardMixin, CheckpointMixin, GracefulStopMixin, ModelCardMixin):
    """What every trainer of a run adds to its TRL trainer (GRPO and SFT phases alike):
    the non-finite guard, checkpoints with a completion marker and our state, Ctrl-C /
    SIGTERM handling and the model card. First base, before the TRL trainer class."""

    def __init__(self, *args: Any, merge_lora_for_generation: bool = True, **kwargs: Any) -> None:
        self.merge_lora_for_generation = merge_lora_for_generation  # read by generation and ValidationCallback
        super().__init__(*args, **kwargs)

    @property
    def stopped_early(self) -> bool:
        """Stopped by a signal or by non-finite updates (not at max_steps)."""
        return self.stopped_nonfinite or self.interrupt.stopped_at is not None


class CrystalGRPOTrainer(
    StepCreditMixin,
    RewardModuleMixin,
    PromptOrderMixin,
    CrystalTrainerMixin,
    MergedGenerationMixin,
    DynamicSamplingMixin,
    GRPOTrainer,
):
    """A drop-in ``trl.GRPOTrainer``: the same constructor, every argument meaning what it
    means in TRL, plus this project's additions (README.md, "Use it from your own code").

    ``reward=`` (a :class:`RewardModule`) replaces ``reward_funcs``: TRL gets one function per
    component for its names and logs, but the trainer evaluates the module once per generation
    batch (``_calculate_rewards``); without it, ``reward_funcs`` behave exactly as in TRL.
    ``reward_objectives`` tags each reward function with its objective, for PCGrad.
    ``sampler_factory=`` orders the prompts (the curriculum). ``validation=`` (with ``reward=``)
    validates on ``eval_dataset`` with the module's metrics and records the best checkpoint.
    ``dynamic_sampling=`` masks or refills the groups whose rewards do not vary; with
    ``reward_funcs`` the outcome is the function whose ``outcome`` attribute is true. A reward
    module's ``step_credit`` gives each step's tokens its own advantage term.
    """

    def __init__(
        self,
        model: Any,
        reward_funcs: Any = None,
        *args: Any,
        reward: RewardModule | None = None,
        reward_objectives: Sequence[str | None] | None = None,
        sampler_factory: Callable | None = None,
        validation: ValidationSection | None = None,
        dynamic_sampling: DynamicSamplingSection | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(
            model,
            reward_funcs,
            *args,
            reward=reward,
            reward_objectives=reward_objectives,
            sampler_factory=sampler_factory,
            **kwargs,
        )
        self.setup_dynamic_sampling(dynamic_sampling)
        self.setup_step_credit()
        self.pin_reward_references()  # after every check: the slow part of building the trainer
        if validation is not None:  # the metrics train/grpo.py runs validate with, for a trainer built by hand
            if self.reward is None or not isinstance(self.eval_dataset, Sized):
                raise ValueError(
                    "validation= reports a reward module's metrics: give reward= (a RewardModule) and "
                    "one eval_dataset whose rows hold the prompt, answer and reference_steps"
                )
            self.add_callback(
                ValidationCallback(self, self.eval_dataset, validation, self.args.output_dir, self.reward)
            )

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        mode = "train" if self.model.training else "eval"
        kl = [v for v in self._metrics[mode].get("kl", []) if not math.isnan(v)]
        if kl:
            logs["kl_max"] = max(kl)
        if mode == "train" and "loss" in logs:
            logs.update(self.curriculum_logs())
        if mode == "train" and torch.cuda.is_available():
            logs["memory/max_allocated_gb"] = torch.cuda.max_memory_allocated() / 2**30
        super().log(logs, start_time)

"""The trainer's side of a reward module (rewards/base.py): one evaluation of each generation batch.

``reward=`` (a :class:`RewardModule`) replaces ``reward_funcs``: TRL gets one reward function
per component, for its names and per-component logs (``rewards/<component>/mean``), but the
trainer does not call them; ``_calculate_rewards`` evaluates the module once per generation
batch. Without it, ``reward_funcs`` behave exactly as in TRL. ``reward_objectives`` tags each
reward function with the objective it serves (``accuracy`` / ``reasoning``; a function's own
``objective`` attribute does too), which PCGrad and dynamic sampling read; each generation batch
leaves its outcome (:attr:`RewardModuleMixin.last_outcome`, the answer's raw correctness) for
dynamic sampling's ``metric: outcome``. The module's state
(the verbosity guard's window) travels with every checkpoint, and the training set's
reference steps are embedded once, before the first step (:meth:`pin_reward_references`).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Sequence
from typing import Any

import torch
from trl.extras.profiling import profiling_decorator

from crystal_grpo.rewards.base import (
    MAX_REWARD,
    OBJECTIVES,
    Batch,
    RewardFunctionError,
    RewardModule,
    Scored,
    value_problem,
)
from crystal_grpo.train.config.refusals import remove_unused_columns_refused

logger = logging.getLogger(__name__)


class RewardModuleMixin:
    """``reward=`` / ``reward_objectives=`` and ``_calculate_rewards`` (module docstring). Before
    :class:`~crystal_grpo.train.trainer.checkpoint_hooks.CheckpointMixin` in the bases (the module's state
    joins the checkpoint state; tests/test_trl_contract.py checks the order)."""

    def __init__(
        self,
        model: Any,
        reward_funcs: Any = None,
        args: Any = None,
        *rest: Any,
        reward: RewardModule | None = None,
        reward_objectives: Sequence[str | None] | None = None,
        **kwargs: Any,
    ) -> None:
        if isinstance(reward_funcs, RewardModule):  # CrystalGRPOTrainer(model, module, ...)
            reward, reward_funcs = reward_funcs, None
        if reward is not None and reward_funcs is not None:
            raise ValueError(
                "CrystalGRPOTrainer: give reward= (a RewardModule) or reward_funcs (as for trl.GRPOTrainer), not both"
            )
        refused = reward is not None and remove_unused_columns_refused(getattr(args, "remove_unused_columns", False))
        if refused:
            raise ValueError(f"{refused[0]}: {refused[1]}")
        self.reward = reward
        # No reward at all: TRL's own error (or an environment_factory's get_reward as the reward).
        super().__init__(model, reward.reward_funcs() if reward is not None else reward_funcs, args, *rest, **kwargs)
        extra = [n for n in self.reward_func_names if n not in reward.objectives] if reward is not None else []
        if extra:  # TRL appended an environment's get_reward as a reward source
            raise ValueError(
                f"CrystalGRPOTrainer(reward=...): the environment_factory's get_reward ({', '.join(extra)}) "
                "would be a second reward beside the reward module, which scores every completion "
                "itself; give the environment no get_reward method, or use plain reward_funcs with it"
            )
        self.reward_objectives = self._objectives(reward_objectives)
        #: Where the outcome comes from: the module's accuracy component, or the first reward function
        #: with a true ``outcome`` attribute (its raw values); None: none (``metric: outcome`` is refused).
        self._outcome_column = next((i for i, f in enumerate(self.reward_funcs) if getattr(f, "outcome", False)), None)
        self.reward_outcome = (
            self.reward.outcome_component
            if self.reward is not None
            else None
            if self._outcome_column is None
            else self.reward_func_names[self._outcome_column]
        )
        #: The last generation batch's outcome, ``[N]`` over all processes (None without a source).
        self.last_outcome: torch.Tensor | None = None
        #: This process's part of the last generation batch's evaluation (None without ``reward=``).
        self.last_scored: Scored | None = None

    def _objectives(self, given: Sequence[str | None] | None) -> list[str | None]:
        """Each of TRL's reward functions' objective (None: untagged)."""
        if self.reward is not None:
            return [self.reward.objectives[name] for name in self.reward_func_names]
        if given is None:
            return [getattr(f, "objective", None) for f in self.reward_funcs]
        given = list(given)
        if len(given) != len(self.reward_funcs) or any(o not in (*OBJECTIVES, None) for o in given):
            raise ValueError(
                f"reward_objectives {given!r}: expected one of {OBJECTIVES} (or None) for each of the "
                f"{len(self.reward_funcs)} reward function(s) {self.reward_func_names}"
            )
        return given

    def pin_reward_references(self) -> None:
        """Embed the training set's reference steps once (``MatchF1Scorer.pin``), so no step does."""
        if self.reward is None:
            return
        start = time.perf_counter()
        pinned = self.reward.pin_references(self.train_dataset)
        if pinned:
            logger.info("embedded %d reference steps before training in %.1f s", pinned, time.perf_counter() - start)

    def crystal_state(self) -> dict:
        state = super().crystal_state()
        return state if self.reward is None else {**state, "rewards": {self.reward.name: self.reward.state_dict()}}

    def load_crystal_state(self, state: dict) -> None:
        super().load_crystal_state(state)
        if self.reward is not None and self.reward.name in state.get("rewards", {}):
            self.reward.load_state_dict(state["rewards"][self.reward.name])

    @profiling_decorator  # as TRL's own: the time goes to wandb/mlflow under profiling/
    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        """TRL's ``[N_global, F]`` rewards from ONE evaluation of the reward module.

        Each process scores its own rows (parsing, answers, embedding: the costly part); the
        per-row numbers are gathered so that the components (the composite's batch
        statistics), the verbosity guard and the diagnostics see the whole generation batch.
        """
        if self.reward is None:  # the user's reward functions, exactly as TRL calls them
            rewards = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
            bad = rewards.isinf() | (rewards.abs() > MAX_REWARD)  # (NaN: TRL's None, not applicable)
            if bool(bad.any()):
                i, j = (int(k) for k in bad.nonzero()[0])
                raise RewardFunctionError(
                    f"reward function {self.reward_func_names[j]!r} returned "
                    f"{value_problem(float(rewards[i, j]))} for completion {i} of the batch"
                )
            column = self._outcome_column
            self.last_outcome = None if column is None else rewards[:, column].double().cpu()
            return rewards
        start = time.perf_counter()
        device = self.accelerator.device
        self.last_scored = self.reward.score(completions, inputs)
        local = self.last_scored.batch
        batch = Batch.from_tensor(
            self.accelerator.gather(local.as_tensor().to(device)).cpu(), len(self.reward.extra_fields)
        )
        comps, metrics = self.reward.rewards(batch, guard=self.model.training)
        self.last_outcome = self.reward.outcome(batch) if self.reward_outcome else None
        metrics.update(self._group_signal(batch, inputs))
        metrics["scoring_seconds"] = time.perf_counter() - start
        for key, value in metrics.items():
            if math.isfinite(value):
                self._log_metric(f"{self.reward.name}/{key}", value)
        return torch.stack([comps[name] for name in self.reward_func_names], dim=1).to(device, torch.float32)

    def _group_signal(self, batch: Batch, inputs: list[dict]) -> dict[str, float]:
        """Whether the answer can teach anything: the share of groups (one prompt's completions)
        whose *accuracy* varies (with none, the answer reward gives every completion of a group
        the same advantage), and the share of easy rows trained on (data with a ``difficulty``)."""
        out = {}
        if len(batch) % self.num_generations == 0 and len(batch):
            groups = batch.correct.reshape(-1, self.num_generations)
            out["accuracy_varies"] = float((groups.amax(dim=1) != groups.amin(dim=1)).double().mean())
        labels = torch.tensor(
            [[float(bool(row.get("difficulty"))), float(row.get("difficulty") == "easy")] for row in inputs],
            device=self.accelerator.device,
        ).reshape(-1, 2)
        labels = self.accelerator.gather(labels)  # on every rank (a collective), labelled or not
        if labels[:, 0].any():
            out["frac_easy"] = float(labels[:, 1].mean())
        return out

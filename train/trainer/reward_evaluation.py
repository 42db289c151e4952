"""The trainer's side of a reward module (rewards/base.py): one evaluation of each generation round.

``reward=`` (a :class:`RewardModule`) replaces ``reward_funcs``: TRL gets one reward function per
component, for its names and per-component logs (``rewards/<component>/mean``), but the trainer does
not call them; :meth:`RewardEvaluation.evaluate` evaluates the module once per generation round.
Without it, ``reward_funcs`` behave exactly as in TRL (:meth:`RewardEvaluation.checked`).
``reward_objectives`` tags each reward function with the objective it serves (``accuracy`` /
``reasoning``; a function's own ``objective`` attribute does too), which PCGrad and dynamic sampling
read; each round leaves its outcome (the answer's raw correctness) for dynamic sampling's
``metric: outcome``. The module's state (the verbosity guard's window) travels with every checkpoint,
and the training set's reference steps are embedded once, before the first step (:meth:`pin`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from crystal_grpo.rewards.base import (
    MAX_REWARD,
    OBJECTIVES,
    Batch,
    RewardFunctionError,
    RewardModule,
    Scored,
    value_problem,
)

if TYPE_CHECKING:
    from crystal_grpo.train.trainer.step_credit import RowCredit

logger = logging.getLogger(__name__)


@dataclass
class Evaluation:
    """One generation round's rewards and what the rest of the round reads from them."""

    rewards: torch.Tensor  #: TRL's ``[N, F]`` over all processes (NaN: not applicable)
    outcome: torch.Tensor | None  #: ``[N]`` the answers' correctness (None: no outcome source)
    scored: Scored | None = None  #: this process's part of the reward module's evaluation
    metrics: dict[str, float] | None = None  #: what the round logs under the reward's name
    credit: list[RowCredit | None] | None = None  #: each completion's step credit (reward.step_credit)


def objectives_of(
    module: RewardModule | None, funcs: Sequence[Any], names: Sequence[str], given: Sequence[str | None] | None
) -> list[str | None]:
    """Each of TRL's reward functions' objective (None: untagged): the module's, ``given``
    (``reward_objectives=``), or each function's own ``objective`` attribute."""
    if module is not None:
        return [module.objectives[name] for name in names]
    if given is None:
        return [getattr(f, "objective", None) for f in funcs]
    given = list(given)
    if len(given) != len(funcs) or any(o not in (*OBJECTIVES, None) for o in given):
        raise ValueError(
            f"reward_objectives {given!r}: expected one of {OBJECTIVES} (or None) for each of the "
            f"{len(funcs)} reward function(s) {list(names)}"
        )
    return given


class RewardEvaluation:
    """The reward module (``module``) or TRL's reward functions (``funcs``, named ``names``) of one
    trainer. ``accelerator`` gathers every process's rows; ``num_generations`` is a group's size."""

    def __init__(
        self,
        module: RewardModule | None,
        funcs: Sequence[Any],
        names: Sequence[str],
        objectives: Sequence[str | None] | None,
        accelerator: Any,
        num_generations: int,
    ) -> None:
        extra = [n for n in names if n not in module.objectives] if module is not None else []
        if extra:  # TRL appended an environment's get_reward as a reward source
            raise ValueError(
                f"CrystalGRPOTrainer(reward=...): the environment_factory's get_reward ({', '.join(extra)}) "
                "would be a second reward beside the reward module, which scores every completion "
                "itself; give the environment no get_reward method, or use plain reward_funcs with it"
            )
        self.module, self.names = module, list(names)
        self.objectives = objectives_of(module, funcs, names, objectives)
        self.accelerator, self.num_generations = accelerator, num_generations
        #: The first reward function with a true ``outcome`` attribute: its raw values are the outcome.
        self.outcome_column = next((i for i, f in enumerate(funcs) if getattr(f, "outcome", False)), None)
        #: Where the outcome comes from: the module's accuracy component, the outcome function, or None.
        self.outcome_source = (
            module.outcome_component
            if module is not None
            else None
            if self.outcome_column is None
            else self.names[self.outcome_column]
        )

    def pin(self, dataset: Any) -> None:
        """Embed the training set's reference steps once (``MatchF1Scorer.pin``), so no step does."""
        if self.module is None:
            return
        start = time.perf_counter()
        pinned = self.module.pin_references(dataset)
        if pinned:
            logger.info("embedded %d reference steps before training in %.1f s", pinned, time.perf_counter() - start)

    def checked(self, rewards: torch.Tensor) -> Evaluation:
        """TRL's own ``[N, F]`` rewards of the user's functions, refused where a value is unusable."""
        bad = rewards.isinf() | (rewards.abs() > MAX_REWARD)  # (NaN: TRL's None, not applicable)
        if bool(bad.any()):
            i, j = (int(k) for k in bad.nonzero()[0])
            raise RewardFunctionError(
                f"reward function {self.names[j]!r} returned "
                f"{value_problem(float(rewards[i, j]))} for completion {i} of the batch"
            )
        column = self.outcome_column
        return Evaluation(rewards, None if column is None else rewards[:, column].double().cpu())

    def evaluate(self, inputs: list[dict], completions: list, training: bool) -> Evaluation:
        """TRL's ``[N, F]`` rewards from ONE evaluation of the reward module.

        Each process scores its own rows (parsing, answers, embedding: the costly part); the per-row
        numbers are gathered so that the components (the composite's batch statistics), the verbosity
        guard (while ``training``) and the diagnostics see the whole round."""
        start = time.perf_counter()
        module, device = self.module, self.accelerator.device
        scored = module.score(completions, inputs)
        everyone = self.accelerator.gather(scored.batch.as_tensor().to(device)).cpu()
        batch = Batch.from_tensor(everyone, len(module.extra_fields))
        comps, metrics = module.rewards(batch, guard=training)
        outcome = module.outcome(batch) if self.outcome_source else None
        metrics.update(self.group_signal(batch, inputs))
        metrics["scoring_seconds"] = time.perf_counter() - start
        rewards = torch.stack([comps[name] for name in self.names], dim=1).to(device, torch.float32)
        return Evaluation(rewards, outcome, scored, metrics)

    def group_signal(self, batch: Batch, inputs: list[dict]) -> dict[str, float]:
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

"""``CrystalGRPOTrainer``: TRL's GRPOTrainer with this project's hooks, each TRL method overridden once, here.

One training step's generation batch, in order (each override below is a few calls on plain objects
the trainer owns; train/trainer/trl_seams.py lists every private TRL name touched):

1. the prompts: ``_get_train_sampler``, the curriculum's order or TRL's made resumable (:class:`PromptOrder`);
2. generation: TRL's, through merged LoRA adapters (``_generate_single_turn``);
3. rewards: ``_calculate_rewards``, the reward module evaluated once (:class:`RewardEvaluation`) or
   TRL's reward functions, and each step's credit (:class:`StepCredit`);
4. advantages: TRL's, then :meth:`add_advantages`: the per-token step term beside them (PCGrad's
   subclass adds each objective's part here);
5. dynamic sampling: ``_generate_and_score_completions`` runs 2-4 once (:meth:`generation_round`), or
   as many rounds as refill asks for, and weighs the flat groups out (:class:`DynamicSampler`);
6. the loss: ``_compute_loss`` is :meth:`loss`, TRL's loss on the advantages plus the step term, its
   surrogate and KL term scaled back to the kept rows where groups were masked (PCGrad,
   train/pcgrad/trainer.py, forms one such loss per objective from one forward pass, with
   :data:`SURROGATE_ONLY` terms, and projects their gradients);
7. the update: TRL's, the optimizer's step behind the non-finite guard.

Every phase's trainer (GRPO and SFT) adds the same run pieces, :class:`CrystalTrainerMixin`: the
non-finite guard, complete checkpoints and their state (one registry, :class:`CheckpointState`),
Ctrl-C / SIGTERM, the model card.
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Callable, Iterator, Sequence, Sized
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from transformers import TrainerCallback
from trl import GRPOTrainer
from trl.extras.profiling import profiling_decorator

from crystal_grpo.rewards.base import RewardModule
from crystal_grpo.train.config.refusals import (
    dynamic_sampling_refused,
    refuse,
    remove_unused_columns_refused,
    step_credit_refused,
)
from crystal_grpo.train.config.run_config import DynamicSamplingSection, ValidationSection
from crystal_grpo.train.models.lora_merge import merged_generate
from crystal_grpo.train.run.checkpoints import optimizer_settings, resolve_resume
from crystal_grpo.train.run.model_card import RunCard, base_model_of
from crystal_grpo.train.trainer.callbacks import ValidationCallback
from crystal_grpo.train.trainer.checkpoint_hooks import (
    CheckpointState,
    complete_checkpoint,
    continue_schedule,
    schedule_warning,
    tied_keys_found,
)
from crystal_grpo.train.trainer.dynamic_sampling import DynamicSampler, loss_scale
from crystal_grpo.train.trainer.interrupt import GracefulStop
from crystal_grpo.train.trainer.nonfinite import NonFiniteGuard
from crystal_grpo.train.trainer.prompt_order import PromptOrder
from crystal_grpo.train.trainer.reward_evaluation import Evaluation, RewardEvaluation
from crystal_grpo.train.trainer.step_credit import STEP_FIELD, StepCredit, credit_tensor, with_step_term

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class LossTerms:
    """Which of TRL's loss terms one ``_compute_loss`` call includes: TRL reads ``beta``,
    ``_entropy_bonus_enabled`` and ``aux_loss_enabled`` when it forms the loss, and this trainer
    answers them through :attr:`CrystalGRPOTrainer.terms` (``kl`` scales ``beta``)."""

    kl: float = 1.0
    entropy_bonus: bool = True
    aux_loss: bool = True


ALL_TERMS = LossTerms()
#: PCGrad's objective losses: the surrogate alone (the KL term, entropy bonus and aux loss are not projected).
SURROGATE_ONLY = LossTerms(kl=0.0, entropy_bonus=False, aux_loss=False)


def _snapshot(logged: Any) -> Any:
    """The contents of TRL's metric or completion log (dicts of lists / deques, nested), as lists."""
    return {k: _snapshot(v) for k, v in logged.items()} if isinstance(logged, dict) else list(logged)


def _restore(logged: Any, saved: Any) -> None:
    """Put :func:`_snapshot`'s contents back in place: keys added since go, every list or deque as it was."""
    if isinstance(logged, dict):
        for key in [k for k in logged if k not in saved]:
            del logged[key]
        for key, value in saved.items():
            _restore(logged[key], value)
    else:
        logged.clear()
        logged.extend(saved)


class _BeforeFirstStep(Exception):
    """Raised by :class:`_StopBeforeFirstStep` once a checkpoint is loaded (``finish_from``)."""


class _StopBeforeFirstStep(TrainerCallback):
    def on_train_begin(self, args, state, control, **kwargs):
        raise _BeforeFirstStep


class CrystalTrainerMixin:
    """What every trainer of a run adds to its TRL trainer (GRPO and SFT phases alike): the
    non-finite guard, checkpoints with a completion marker and our state, Ctrl-C / SIGTERM
    handling and the model card. First base, before the TRL trainer class."""

    def __init__(
        self, *args: Any, max_consecutive_nonfinite: int = 5, merge_lora_for_generation: bool = True, **kwargs: Any
    ) -> None:
        self.merge_lora_for_generation = merge_lora_for_generation  # read by generation and ValidationCallback
        super().__init__(*args, **kwargs)
        self.guard = NonFiniteGuard(max_consecutive_nonfinite)
        self.interrupt = GracefulStop()  # stops after a save inside ``with trainer.interrupt.handling():``
        self.add_callback(self.guard)
        self.add_callback(self.interrupt)
        self.card = RunCard(self.args.output_dir)
        #: What travels in a checkpoint's crystal_state.json: each part registered by what keeps it.
        self.checkpoint_state = CheckpointState()
        self.checkpoint_state.register("nonfinite_skipped", self.guard.state_dict, self.guard.load_state_dict)
        self.checkpoint_state.register("settings", lambda: optimizer_settings(self.optimizer, self.lr_scheduler))

    @property
    def stopped_early(self) -> bool:
        """Stopped by a signal or by non-finite updates (not at max_steps)."""
        return self.guard.stopped or self.interrupt.stopped_at is not None

    def create_optimizer(self, model=None):
        optimizer = super().create_optimizer(model) if model is not None else super().create_optimizer()
        self.guard.wrap(optimizer, self.accelerator.device)
        return optimizer

    def train(self, resume_from_checkpoint: str | bool | None = None, *args: Any, **kwargs: Any):
        """``True`` or ``"latest"`` resume from the newest *complete* checkpoint of ``output_dir``
        (HF's own ``True`` takes the newest folder, complete or not); none yet: a fresh start."""
        if resume_from_checkpoint is True or resume_from_checkpoint == "latest":
            resume_from_checkpoint = resolve_resume(self.args.output_dir, "latest")
        return super().train(resume_from_checkpoint, *args, **kwargs)

    def finish_from(self, checkpoint: str) -> None:
        """End a phase whose ``checkpoint`` already holds its last step: load it (weights, state) and
        run the end-of-training callbacks (final validation, plot) without a step. HF's loop always
        trains one step after resuming, even at ``max_steps``, which would train a finished run past its end."""
        stop = _StopBeforeFirstStep()
        self.add_callback(stop)  # last: every other callback has seen on_train_begin
        try:
            self.train(resume_from_checkpoint=checkpoint)
        except _BeforeFirstStep:
            pass
        finally:
            self.remove_callback(stop)
        self.control = self.callback_handler.on_train_end(self.args, self.state, self.control)

    def _save_checkpoint(self, model, trial):
        run_dir, step = self._get_output_dir(trial=trial), self.state.global_step
        with complete_checkpoint(run_dir, step, self.accelerator, self.args.should_save) as folder:
            super()._save_checkpoint(model, trial)
            if self.args.should_save:
                self.checkpoint_state.write(folder)

    def _load_optimizer_and_scheduler(self, checkpoint):
        super()._load_optimizer_and_scheduler(checkpoint)
        if not checkpoint:
            return
        self.checkpoint_state.read(checkpoint)
        warning = schedule_warning(continue_schedule(self.optimizer, self.lr_scheduler), self.args)
        if warning and self.accelerator.is_main_process:
            logger.warning(warning)

    def _issue_warnings_after_load(self, load_result: Any) -> None:
        super()._issue_warnings_after_load(tied_keys_found(self.model, load_result))

    def create_model_card(
        self, model_name: str | None = None, dataset_name: str | None = None, tags: str | list[str] | None = None
    ) -> None:
        """This project's card (main process) instead of TRL's (train/run/model_card.py)."""
        if self.is_world_process_zero():
            name = model_name or Path(self.args.output_dir).name
            self.card.write(base_model_of(self.model), name, self.card_rewards(), self._name)

    def card_rewards(self) -> list[str]:
        """The reward functions the card names (none for a trainer without rewards)."""
        return []

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        logs.update(self.log_additions(logs))
        super().log(logs, start_time)

    def log_additions(self, logs: dict[str, float]) -> dict[str, float]:
        """What this project adds to a log row: the skipped non-finite updates (training rows)."""
        return self.guard.logs() if self.model.training else {}


class CrystalGRPOTrainer(CrystalTrainerMixin, GRPOTrainer):
    """A drop-in ``trl.GRPOTrainer``: the same constructor, every argument meaning what it
    means in TRL, plus this project's additions (README.md, "Use it from your own code").

    ``reward=`` (a :class:`RewardModule`) replaces ``reward_funcs``: TRL gets one function per
    component for its names and logs, but the trainer evaluates the module once per generation
    round; without it, ``reward_funcs`` behave exactly as in TRL. ``reward_objectives`` tags each
    reward function with its objective, for PCGrad. ``sampler_factory=`` orders the prompts (the
    curriculum). ``validation=`` (with ``reward=``) validates on ``eval_dataset`` with the module's
    metrics and records the best checkpoint. ``dynamic_sampling=`` masks or refills the groups whose
    rewards do not vary; with ``reward_funcs`` the outcome is the function whose ``outcome``
    attribute is true. A reward module's ``step_credit`` gives each step's tokens its own advantage term.
    """

    #: PCGrad's subclass (train/pcgrad/trainer.py) sets it; dynamic sampling's ``metric: objectives`` needs it.
    pcgrad = False
    #: The loss terms TRL's next ``_compute_loss`` call reads (:meth:`loss`).
    terms = ALL_TERMS

    def __init__(
        self,
        model: Any,
        reward_funcs: Any = None,
        args: Any = None,
        *rest: Any,
        reward: RewardModule | None = None,
        reward_objectives: Sequence[str | None] | None = None,
        sampler_factory: Callable | None = None,
        validation: ValidationSection | None = None,
        dynamic_sampling: DynamicSamplingSection | None = None,
        **kwargs: Any,
    ) -> None:
        if isinstance(reward_funcs, RewardModule):  # CrystalGRPOTrainer(model, module, ...)
            reward, reward_funcs = reward_funcs, None
        if reward is not None and reward_funcs is not None:
            raise ValueError(
                "CrystalGRPOTrainer: give reward= (a RewardModule) or reward_funcs (as for trl.GRPOTrainer), not both"
            )
        refuse(reward is not None and args is not None and remove_unused_columns_refused(args.remove_unused_columns))
        self.reward = reward
        self.prompt_order = PromptOrder(sampler_factory)
        # No reward at all: TRL's own error (or an environment_factory's get_reward as the reward).
        super().__init__(model, reward.reward_funcs() if reward is not None else reward_funcs, args, *rest, **kwargs)
        self.add_callback(self.prompt_order.epoch)
        names, n = self.reward_func_names, self.num_generations
        self.rewards = RewardEvaluation(reward, self.reward_funcs, names, reward_objectives, self.accelerator, n)
        self.reward_objectives = self.rewards.objectives
        if reward is not None:
            self.checkpoint_state.register("rewards", self._reward_state, self._load_reward_state)
        self.dynamic_sampler = self._dynamic_sampler(dynamic_sampling)
        weight = reward.step_credit.weight if reward is not None else 0.0
        self.step_credit = None
        if weight:
            refuse(step_credit_refused(self.importance_sampling_level, self.loss_type))
            tokenizer = getattr(self.processing_class, "tokenizer", self.processing_class)  # a processor's own
            self.step_credit = StepCredit(weight, tokenizer, self.accelerator, self.scale_rewards)
        self._evaluation: Evaluation | None = None  # what _calculate_rewards leaves for generation_round
        self.rewards.pin(self.train_dataset)  # after every check: the slow part of building the trainer
        if validation is not None:  # the metrics train/grpo.py runs validate with, for a trainer built by hand
            if reward is None or not isinstance(self.eval_dataset, Sized):
                raise ValueError(
                    "validation= reports a reward module's metrics: give reward= (a RewardModule) and "
                    "one eval_dataset whose rows hold the prompt, answer and reference_steps"
                )
            self.add_callback(ValidationCallback(self, self.eval_dataset, validation, self.args.output_dir, reward))

    def _dynamic_sampler(self, section: DynamicSamplingSection | None) -> DynamicSampler | None:
        """``dynamic_sampling=`` checked against the trainer, as the config's check does (None: off)."""
        if section is None or section.mode == "none":
            return None
        refuse(
            dynamic_sampling_refused(
                section,
                pcgrad=self.pcgrad,
                scale_rewards=self.scale_rewards,
                aggregation=self.multi_objective_aggregation,
                outcome=self.rewards.outcome_source,
                step_credit=self.reward is not None and self.reward.step_credit.on,
            )
        )
        return DynamicSampler(
            section,
            num_generations=self.num_generations,
            reward_weights=self.reward_weights,
            objectives=self.reward_objectives,
            loss_type=self.loss_type,
            accelerator=self.accelerator,
            dataset=self.train_dataset,
            local_batch=self.args.per_device_train_batch_size * self.args.steps_per_generation,
            seed=self.args.seed,
            pool=lambda step: self.prompt_order.pool(step, len(self.train_dataset)),
            pad_token_id=self._tokenizer.pad_token_id,
        )

    def _reward_state(self) -> dict:
        return {self.reward.name: self.reward.state_dict()}

    def _load_reward_state(self, state: dict) -> None:
        if self.reward.name in state:
            self.reward.load_state_dict(state[self.reward.name])

    # -- 1. the prompts ---------------------------------------------------------------------------
    def _get_train_sampler(self, dataset=None):
        if self.prompt_order.factory is None:  # TRL's order, with the epoch a resumed run is in
            return self.prompt_order.resumable(super()._get_train_sampler(dataset))
        data = dataset if dataset is not None else self.train_dataset
        return self.prompt_order.curriculum_sampler(data, self.args, self.num_generations)

    # -- 2. generation ----------------------------------------------------------------------------
    def _generate_single_turn(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        """TRL's, its ``generate`` call through merged LoRA adapters (``merge_lora_for_generation``): the
        merge happens inside TRL's context, where ZeRO-3 weights are gathered (train/models/lora_merge.py)."""
        with merged_generate(self.accelerator.unwrap_model(self.model_wrapped), self.merge_lora_for_generation):
            return super()._generate_single_turn(
                prompt_ids, images, multimodal_fields, num_generations, has_tool_images
            )

    # -- 3. rewards -------------------------------------------------------------------------------
    @profiling_decorator  # as TRL's own: the time goes to wandb/mlflow under profiling/
    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        """TRL's ``[N, F]`` rewards of the round: the reward module evaluated once, or TRL's own
        functions; with step credit, each step's credit. What the round's advantages read is kept."""
        if self.reward is None:  # the user's reward functions, exactly as TRL calls them
            rewards = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
            evaluation = self.rewards.checked(rewards)
        else:
            evaluation = self.rewards.evaluate(inputs, completions, self.model.training)
            self._log_metrics(self.reward.name, evaluation.metrics)
        if self.step_credit is not None:
            size = self.num_generations if self.model.training else self.num_generations_eval
            evaluation.credit, metrics = self.step_credit.rows(evaluation.scored, prompts, completion_ids_list, size)
            self._log_metrics("step_credit", metrics)
        self._evaluation = evaluation
        return evaluation.rewards

    def _log_metrics(self, prefix: str, metrics: dict[str, float]) -> None:
        """``prefix/<name>``, logged as TRL logs its reward functions' metrics (averaged over processes)."""
        for key, value in metrics.items():
            if math.isfinite(value):
                self._log_metric(f"{prefix}/{key}", value)

    # -- 4. advantages ----------------------------------------------------------------------------
    def add_advantages(self, batch: dict[str, Any], evaluation: Evaluation) -> None:
        """Where rewards become advantages, after TRL's: the per-token step term (``step_advantages``)
        beside TRL's ``advantages``. PCGrad's subclass adds each objective's part here."""
        if evaluation.credit is not None:
            ids = batch["completion_ids"]
            batch[STEP_FIELD] = credit_tensor(evaluation.credit, ids.shape[1]).to(ids.device)

    # -- 5. the generation batch: one round, or dynamic sampling's --------------------------------
    def _generate_and_score_completions(self, inputs):
        """The generation batch of a step (or of an evaluation): one round, or in training with
        ``dynamic_sampling`` as many as refill asks for, the flat groups weighed out."""
        if self.dynamic_sampler is None or not self.model.training:
            return self.generation_round(inputs)[0]
        batch, metrics = self.dynamic_sampler.batch(inputs, self.generation_round, self.state.global_step)
        for key, value in metrics.items():
            self._metrics["train"][key].append(value)
        return batch

    def generation_round(self, inputs: list[dict], quiet: bool = False) -> tuple[dict[str, Any], Evaluation]:
        """One round of TRL's generation and scoring (2-4 above) and its rewards. ``quiet``: it logs
        nothing (a refill round; TRL's metrics describe the step's first round)."""
        with self.quiet_logs() if quiet else contextlib.nullcontext():
            batch = super()._generate_and_score_completions(inputs)
            evaluation, self._evaluation = self._evaluation, None
            self.add_advantages(batch, evaluation)
        return batch, evaluation

    @contextlib.contextmanager
    def quiet_logs(self) -> Iterator[None]:
        """Within, what TRL logs (its metrics, its completions' table) is undone on exit."""
        saved = _snapshot(self._metrics), _snapshot(self._logs)
        try:
            yield
        finally:
            _restore(self._metrics, saved[0])
            _restore(self._logs, saved[1])

    # -- 6. the loss ------------------------------------------------------------------------------
    def _compute_loss(self, model, inputs):
        return self.loss(model, inputs)

    def loss(self, model: Any, inputs: dict[str, Any], terms: LossTerms = ALL_TERMS) -> torch.Tensor:
        """Where the loss is formed: TRL's ``_compute_loss`` with ``terms``, on ``advantages`` plus the
        per-token step term; where dynamic sampling masked groups of a row-mean loss, the surrogate and the
        KL term are scaled by its :func:`loss_scale`, as the advantages and ``beta`` enter both linearly."""
        advantages = with_step_term(inputs["advantages"], inputs.get(STEP_FIELD))
        scale = loss_scale(inputs)
        if scale != 1.0:
            advantages, terms = advantages * scale, replace(terms, kl=terms.kl * scale)
        if advantages is not inputs["advantages"]:
            inputs = {**inputs, "advantages": advantages}
        self.terms = terms
        try:
            return super()._compute_loss(model, inputs)
        finally:
            del self.terms  # back to the class's: every term

    @property
    def beta(self) -> float:
        """TRL's KL coefficient as its loss reads it: ``args.beta`` times :attr:`terms`' ``kl``."""
        return self._beta_as_set * self.terms.kl

    @beta.setter
    def beta(self, value: float) -> None:
        self._beta_as_set = value

    @property
    def _entropy_bonus_enabled(self) -> bool:
        return self._entropy_bonus_as_set and self.terms.entropy_bonus

    @_entropy_bonus_enabled.setter
    def _entropy_bonus_enabled(self, value: bool) -> None:
        self._entropy_bonus_as_set = value

    @property
    def aux_loss_enabled(self) -> bool:
        return self._aux_loss_as_set and self.terms.aux_loss

    @aux_loss_enabled.setter
    def aux_loss_enabled(self, value: bool) -> None:
        self._aux_loss_as_set = value

    # -- the log and the card ---------------------------------------------------------------------
    def log_additions(self, logs: dict[str, float]) -> dict[str, float]:
        """Besides the guard's count: the KL maximum over the logging window, the curriculum's record of
        the step's chunk, and the GPU's peak memory."""
        out: dict[str, float] = {}
        training = self.model.training
        kl = [v for v in self._metrics["train" if training else "eval"].get("kl", []) if not math.isnan(v)]
        if kl:
            out["kl_max"] = max(kl)
        if training and "loss" in logs:
            out.update(self.prompt_order.logs(self.state.global_step - 1))
        if training and torch.cuda.is_available():
            out["memory/max_allocated_gb"] = torch.cuda.max_memory_allocated() / 2**30
        return {**out, **super().log_additions(logs)}

    def card_rewards(self) -> list[str]:
        return list(self.reward_func_names)

"""PCGrad (Yu et al. 2020) between the accuracy and the reasoning objectives (docs/method.md section 9).

``PCGradGRPOTrainer`` is the trainer of runs with ``pcgrad: true``; other runs never load it. It uses
two named hooks of ``CrystalGRPOTrainer`` (train/trainer/grpo_trainer.py): ``add_advantages``, where it
adds each objective's part of the advantage, and ``loss``, where it forms one loss per objective; and
three TRL methods the base trainer leaves alone: ``training_step`` (PCGrad's step runs without DDP's
hooks), ``compute_loss`` (the losses and their backward passes) and ``_get_per_token_logps_and_entropies``
(one forward pass shared by them). The projection is train/pcgrad/math.py, the gradient sums of an
accumulation window train/pcgrad/gradients.py, their memory plan train/pcgrad/memory.py. How it runs
under DDP and ZeRO-3: docs/method.md section 9, "How it runs inside TRL's GRPOTrainer".
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

from crystal_grpo.train.config.refusals import (
    aggregation_refused,
    liger_refused,
    off_policy_mask_refused,
    refuse,
    zero_stage_problem,
)
from crystal_grpo.train.pcgrad.gradients import (
    AccumulationWindow,
    is_deepspeed_engine,
    open_window,
    restore_counters,
    zero3_backward_counters,
)
from crystal_grpo.train.pcgrad.math import (  # noqa: F401 - public here (README, docs)
    objective_advantages,
    pcgrad_coefficients,
    pcgrad_stats,
    project_conflicting,
)
from crystal_grpo.train.pcgrad.memory import (  # noqa: F401 - pcgrad_extra_partitions: public here
    ACCURACY,
    REASONING,
    REST,
    pcgrad_extra_partitions,
)
from crystal_grpo.train.trainer.dynamic_sampling import objective_inputs
from crystal_grpo.train.trainer.grpo_trainer import SURROGATE_ONLY, CrystalGRPOTrainer
from crystal_grpo.train.trainer.reward_evaluation import Evaluation
from crystal_grpo.train.trainer.step_credit import STEP_FIELD

logger = logging.getLogger(__name__)

#: The TRL minor version these hooks were verified against (tests/test_trl_contract.py);
#: pyproject.toml pins it.
TESTED_TRL = "1.16"
#: Relative tolerance of the run-time check acc + reason == TRL's advantage.
SUM_CHECK_RTOL = 1e-3
#: The losses a PCGrad step backpropagates: each objective's, with the advantages column it reads.
OBJECTIVE_ADVANTAGES = {ACCURACY: "advantages_acc", REASONING: "advantages_reason"}
#: What TRL's loss rebinds on the trainer besides its metrics: the adaptive entropy controller's state
#: (tests/test_trl_contract.py). The rest loss must see it as the plain loss did, and leave it as that left it.
ENTROPY_CONTROLLER = ("entropy_coef", "_last_world_entropy", "_entropy_window_stats")


def entropy_controller(trainer: Any, state: dict[str, Any] | None = None) -> dict[str, Any]:
    """TRL's adaptive entropy controller's state on ``trainer`` (:data:`ENTROPY_CONTROLLER`), set to
    ``state`` first if given."""
    for name, value in (state or {}).items():
        setattr(trainer, name, value)
    return {name: getattr(trainer, name) for name in ENTROPY_CONTROLLER}


class PCGradGRPOTrainer(CrystalGRPOTrainer):
    """The trainer of ``pcgrad: true`` runs (see :func:`trainer_class`; module docstring).

    ``pcgrad_objective_std``: divide each objective's advantage by its own std instead of the
    total's. ``self.pcgrad`` may be switched off between steps (benchmarks compare both in
    one trainer); off, every hook defers to plain TRL GRPO.
    """

    def __init__(
        self,
        model: Any,
        reward_funcs: Any = None,
        args: Any = None,
        *rest: Any,
        pcgrad_objective_std: bool = False,
        **kwargs: Any,
    ) -> None:
        self.pcgrad, self.pcgrad_objective_std = True, pcgrad_objective_std
        refuse(args is not None and liger_refused(args.use_liger_kernel))  # before TRL patches the model with them
        super().__init__(model, reward_funcs, args, *rest, **kwargs)
        self._window: AccumulationWindow | None = None
        self._in_step = False
        self._overhead = 0.0
        self._forward: dict[str, Any] | None = None
        self.objectives = self._checked_objectives()

    # -- configuration checks ----------------------------------------------------------
    def _checked_objectives(self) -> list[str]:
        """The objective of each of TRL's reward columns, where PCGrad can run with these settings."""
        import trl
        from accelerate.utils import DistributedType

        if not trl.__version__.startswith(TESTED_TRL + "."):
            logger.warning(
                "pcgrad: TRL %s is installed, but PCGrad's hooks into TRL internals were verified "
                "against TRL %s.x only (tests/test_trl_contract.py); run that test first",
                trl.__version__,
                TESTED_TRL,
            )
        refuse(aggregation_refused(self.multi_objective_aggregation))
        refuse(off_policy_mask_refused(self.off_policy_mask_threshold))
        untagged = [n for n, o in zip(self.reward_func_names, self.reward_objectives) if o is None]
        if untagged:
            raise ValueError(
                f"pcgrad: reward function(s) {untagged} have no objective; tag every reward function "
                "with reward_objectives=['accuracy', 'reasoning', ...] (one per function) or a "
                "function attribute fn.objective = 'accuracy' | 'reasoning'"
            )
        objs = list(self.reward_objectives)
        if len(set(objs) | ({REASONING} if self.step_credit is not None else set())) < 2:  # step credit: reasoning's
            logger.warning(
                "pcgrad: every reward function serves %r; the other objective's gradient is zero "
                "and PCGrad reduces to plain GRPO",
                objs[0] if objs else None,
            )
        dt = self.accelerator.distributed_type
        if dt == DistributedType.DEEPSPEED:
            problem = zero_stage_problem(self.accelerator.state.deepspeed_plugin.zero_stage)
            if problem:
                raise NotImplementedError(problem)
            zcfg = self.accelerator.state.deepspeed_plugin.deepspeed_config.get("zero_optimization", {})
            if (zcfg.get("offload_optimizer") or {}).get("device", "none") not in ("none", None):
                raise NotImplementedError(
                    "pcgrad with ZeRO-3 optimizer offload: the offloaded gradient buffer is only filled at the "
                    "accumulation boundary, so per-objective gradients cannot be separated; disable "
                    "offload_optimizer or set pcgrad: false."
                )
        elif dt in (DistributedType.FSDP, DistributedType.MEGATRON_LM, DistributedType.XLA):
            raise NotImplementedError(f"pcgrad is implemented for one process, DDP and DeepSpeed ZeRO-3; not {dt}.")
        return objs

    # -- 1. rewards become each objective's advantages -------------------------------------------
    def add_advantages(self, batch: dict[str, Any], evaluation: Evaluation) -> None:
        super().add_advantages(batch, evaluation)
        if self.pcgrad and self.model.training:
            batch.update(self.objective_parts(evaluation.rewards, batch["advantages"]))

    def objective_parts(self, rewards: torch.Tensor, adv: torch.Tensor) -> dict[str, torch.Tensor]:
        """``advantages_acc`` / ``advantages_reason`` of this process's rows from the round's global
        ``[N, F]`` rewards, checked to add up to TRL's ``adv`` (same rows, groups and scaling)."""
        acc, reason, total = objective_advantages(
            rewards,
            self.objectives,
            self.reward_weights,
            self.num_generations,
            self.scale_rewards,
            self.pcgrad_objective_std,
        )
        n = adv.shape[0]
        mine = slice(self.accelerator.process_index * n, (self.accelerator.process_index + 1) * n)
        acc, reason, total = (t[mine].to(device=adv.device) for t in (acc, reason, total))
        scale = 1.0 + adv.abs().max().item() if n else 1.0
        err = (total - adv.double()).abs().max().item() if n else 0.0
        if err > SUM_CHECK_RTOL * scale:
            raise RuntimeError(
                f"pcgrad: recomputed advantages differ from TRL's by {err:.3g}; the objective "
                "split would not add up to the GRPO advantage"
            )
        if not self.pcgrad_objective_std:
            err = (acc + reason - adv.double()).abs().max().item() if n else 0.0
            if err > SUM_CHECK_RTOL * scale:
                raise RuntimeError(
                    f"pcgrad: advantages_acc + advantages_reason differ from TRL's advantage by {err:.3g}"
                )
        return {"advantages_acc": acc.to(adv.dtype), "advantages_reason": reason.to(adv.dtype)}

    # -- 2. losses from one forward -------------------------------------------------------------
    @contextlib.contextmanager
    def _one_forward(self) -> Iterator[None]:
        """Every ``_get_per_token_logps_and_entropies`` call inside returns the first one's result
        (graph included), so several losses share one forward."""
        self._forward = {}
        try:
            yield
        finally:
            self._forward = None

    def _get_per_token_logps_and_entropies(self, *args: Any, **kwargs: Any):
        """TRL's, or inside :meth:`_one_forward` the first call's result again."""
        cache = self._forward
        if cache is None:
            return super()._get_per_token_logps_and_entropies(*args, **kwargs)
        if "out" not in cache:
            with torch.enable_grad():
                cache["out"] = super()._get_per_token_logps_and_entropies(*args, **kwargs)
        return cache["out"]

    def pcgrad_losses(self, model, inputs) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """(plain GRPO loss, detached, with TRL's metrics logged; {accuracy, reasoning(, rest): loss}).

        All from ONE forward. accuracy / reasoning: the trainer's loss with the objective's advantages
        and :data:`SURROGATE_ONLY` terms (no KL term, no entropy bonus, no aux loss). rest, only when any
        of those is on: the same call with zero advantages and every term, so it holds exactly the KL
        penalty (+ entropy bonus + aux loss) with TRL's normalisation, the adaptive entropy controller as
        the plain loss saw it. The KL term is NOT projected: it is the trust region anchoring the policy
        to the reference for both objectives; projecting it against an objective would let that
        objective cancel the anchor. It is added after the projection. ``inputs`` flows into every call
        with only ``advantages`` replaced, so any column TRL's loss reads (a mask) applies to every loss.
        """
        rest = self.beta != 0.0 or self._entropy_bonus_enabled or self.aux_loss_enabled
        with self._one_forward():
            before = entropy_controller(self)
            with torch.no_grad():  # the forward inside still records its graph
                plain = super().compute_loss(model, inputs)
            after = entropy_controller(self)
            with self.quiet_logs():  # the extra losses log nothing
                # objective_inputs: the objective's own loss mask under dynamic_sampling.metric: objectives;
                # the per-token step term (reward.step_credit) is the reasoning objective's alone
                losses = {
                    name: self.loss(
                        model,
                        {
                            **objective_inputs(inputs, name),
                            "advantages": inputs[key],
                            STEP_FIELD: inputs.get(STEP_FIELD) if name == REASONING else None,
                        },
                        SURROGATE_ONLY,
                    )
                    for name, key in OBJECTIVE_ADVANTAGES.items()
                }
                if rest:
                    entropy_controller(self, before)
                    zeros = torch.zeros_like(inputs["advantages"])
                    losses[REST] = self.loss(model, {**inputs, "advantages": zeros, STEP_FIELD: None})
                    entropy_controller(self, after)
        return plain.detach(), losses

    # -- 3. the training step: TRL's, its loss's backward passes PCGrad's -----------------------
    def training_step(self, model, inputs, num_items_in_batch=None):
        if not self.pcgrad:
            return super().training_step(model, inputs, num_items_in_batch)
        # DDP: several backward passes through one DDP forward would confuse its reducer, so
        # all of it runs without DDP's hooks; the window averages the sums itself.
        with self.accelerator.no_sync(model):
            self._in_step = True
            try:
                return super().training_step(model, inputs, num_items_in_batch)
            finally:
                self._in_step = False

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        """In a PCGrad training step: PCGrad's losses, their backward passes into the window and, at the
        accumulation boundary, the projected update; it returns the plain loss (what the step logs) on a
        leaf of its own, so the backward transformers then runs on it reaches no parameter."""
        if not self._in_step:
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        plain, losses = self.pcgrad_losses(model, inputs)
        self._backward(model, losses)
        return plain.requires_grad_().clone()  # (a graph of one node: DeepSpeed's backward wants a grad_fn)

    def _backward(self, model, losses: dict[str, torch.Tensor]) -> None:
        """One backward pass per PCGrad loss into the window's sums; at the accumulation boundary the
        projected update is written into the gradient storage (the optimizer's step, and under DeepSpeed
        the engine's, follow as for plain GRPO)."""
        started = time.perf_counter()
        if self._window is None:
            self._window = open_window(model, self.current_gradient_accumulation_steps, REST in losses)
        window, boundary = self._window, self.accelerator.sync_gradients
        names = window.order(losses)
        late = [losses[REST]] if REST in losses and REST not in names else []
        if late and not boundary:
            raise RuntimeError("pcgrad: a one-micro-step window must end at an accumulation boundary")
        spent: list[float] = []
        passes = self._backward_passes(model, [losses[n] for n in names] + late, spent)
        for name, run in zip(names, passes):
            window.accumulate(name, run)
        if boundary:
            stats = window.project(late_backward=passes[-1] if late else None)
            self._window = None
        # Extra cost over plain GRPO: the backward passes beyond the first one (their share of the
        # backward time) plus the swaps, reduction and projection.
        self._overhead += (time.perf_counter() - started) - sum(spent) / len(passes)
        if boundary:
            stats["overhead_seconds"], self._overhead = self._overhead, 0.0
            for k, v in stats.items():
                self._metrics["train"][f"pcgrad/{k}"].append(v)

    def _backward_passes(self, model, losses: list[torch.Tensor], spent: list[float]) -> list[Callable[[], None]]:
        """One callable per loss running its backward pass (the graph retained for the next ones;
        the seconds each took appended to ``spent``)."""
        zero3 = is_deepspeed_engine(model)
        counters = zero3_backward_counters(model) if zero3 else None

        def one(i: int, loss: torch.Tensor) -> Callable[[], None]:
            retain = i < len(losses) - 1

            def run() -> None:
                t = time.perf_counter()
                if zero3:
                    if i:
                        restore_counters(counters)
                    model.set_gradient_accumulation_boundary(is_boundary=self.accelerator.sync_gradients)
                    model.backward(loss, retain_graph=retain, scale_wrt_gas=False)  # loss already scaled (TRL)
                else:
                    self.accelerator.backward(loss, retain_graph=retain)
                spent.append(time.perf_counter() - t)

            return run

        return [one(i, loss) for i, loss in enumerate(losses)]


def trainer_class(pcgrad: bool) -> type[CrystalGRPOTrainer]:
    """The trainer for a run: plain TRL plus our hooks, or its PCGrad subclass when asked for."""
    return PCGradGRPOTrainer if pcgrad else CrystalGRPOTrainer

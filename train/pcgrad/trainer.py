"""PCGrad (Yu et al. 2020) between the accuracy and the reasoning objectives (docs/method.md section 9).

``PCGradGRPOTrainer`` (``PCGradMixin`` over ``CrystalGRPOTrainer``) is the trainer of runs with
``pcgrad: true``; other runs never load these hooks. This module holds the hooks into TRL's
``GRPOTrainer`` and the public names; the projection is ``train/pcgrad/math.py``, the gradient
sums of an accumulation window ``train/pcgrad/gradients.py``, their memory plan
``train/pcgrad/memory.py``. How the hooks split the advantage, take one backward pass per
objective from one forward and project at the accumulation boundary, under DDP and ZeRO-3:
docs/method.md section 9, "How it runs inside TRL's GRPOTrainer".
"""

from __future__ import annotations

import contextlib
import functools
import logging
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch

from crystal_grpo.train.config.refusals import (
    aggregation_refused,
    liger_refused,
    off_policy_mask_refused,
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
from crystal_grpo.train.pcgrad.memory import (
    ACCURACY,
    REASONING,
    REST,
    pcgrad_extra_partitions,  # noqa: F401 - public here
)
from crystal_grpo.train.trainer.dynamic_sampling import objective_inputs
from crystal_grpo.train.trainer.grpo_trainer import CrystalGRPOTrainer
from crystal_grpo.train.trainer.step_credit import STEP_FIELD

logger = logging.getLogger(__name__)

#: The TRL minor version these hooks were verified against (tests/test_trl_contract.py);
#: pyproject.toml pins it.
TESTED_TRL = "1.16"
#: Relative tolerance of the run-time check acc + reason == TRL's advantage.
SUM_CHECK_RTOL = 1e-3
#: The losses a PCGrad step backpropagates: each objective's, with the advantages column it reads.
OBJECTIVE_ADVANTAGES = {ACCURACY: "advantages_acc", REASONING: "advantages_reason"}

_MISSING = object()


def reset_attributes(obj: Any, saved: dict[str, Any]) -> None:
    """Rebind ``obj``'s attributes to a ``dict(vars(obj))`` snapshot: attributes added since are
    removed, rebound ones restored. Objects mutated in place stay mutated (TRL's loss mutates only
    its metrics lists in place, which PCGrad swaps out: tests/test_trl_contract.py)."""
    current = vars(obj)
    for k in [k for k in current if k not in saved]:
        del current[k]
    for k, v in saved.items():
        if current.get(k, _MISSING) is not v:
            current[k] = v


class PCGradMixin:
    """PCGrad hooks for ``GRPOTrainer`` (docs/method.md section 9, "How it runs inside TRL's GRPOTrainer").

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
        refused = liger_refused(getattr(args, "use_liger_kernel", False))
        if refused:  # before TRL patches the model with them
            raise ValueError(f"{refused[0]}: {refused[1]}")
        super().__init__(model, reward_funcs, args, *rest, **kwargs)
        self._pcgrad_rewards = None
        self._pcgrad_window: AccumulationWindow | None = None
        self._pcgrad_in_step = False
        self._pcgrad_pending: dict[str, torch.Tensor] | None = None
        self._pcgrad_overhead = 0.0
        self._pcgrad_check_supported()

    # -- configuration checks ----------------------------------------------------------
    def _pcgrad_objectives(self) -> list[str]:
        """The objective of each of TRL's reward columns (``CrystalGRPOTrainer.reward_objectives``)."""
        untagged = [n for n, o in zip(self.reward_func_names, self.reward_objectives) if o is None]
        if untagged:
            raise ValueError(
                f"pcgrad: reward function(s) {untagged} have no objective; tag every reward function "
                "with reward_objectives=['accuracy', 'reasoning', ...] (one per function) or a "
                "function attribute fn.objective = 'accuracy' | 'reasoning'"
            )
        return list(self.reward_objectives)

    def _pcgrad_check_supported(self) -> None:
        import trl
        from accelerate.utils import DistributedType

        if not trl.__version__.startswith(TESTED_TRL + "."):
            logger.warning(
                "pcgrad: TRL %s is installed, but PCGrad's hooks into TRL internals were verified "
                "against TRL %s.x only (tests/test_trl_contract.py); run that test first",
                trl.__version__,
                TESTED_TRL,
            )

        refused = aggregation_refused(self.multi_objective_aggregation) or off_policy_mask_refused(
            self.off_policy_mask_threshold
        )
        if refused:
            raise ValueError(f"{refused[0]}: {refused[1]}")
        objs = self._pcgrad_objectives()
        if len(set(objs) | ({REASONING} if self.step_credit_weight else set())) < 2:  # step credit: reasoning's
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

    # -- 1. rewards and objective advantages --------------------------------------------
    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        rewards_per_func = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        if self.pcgrad:
            self._pcgrad_rewards = rewards_per_func  # global (gathered) [N, F]
        return rewards_per_func

    def _generate_and_score_completions(self, inputs):
        out = super()._generate_and_score_completions(inputs)
        if not self.pcgrad or not self.model.training or self._pcgrad_rewards is None:
            return out
        rewards, self._pcgrad_rewards = self._pcgrad_rewards, None
        acc, reason, total = objective_advantages(
            rewards,
            self._pcgrad_objectives(),
            self.reward_weights,
            self.num_generations,
            self.scale_rewards,
            self.pcgrad_objective_std,
        )
        adv = out["advantages"]
        n = adv.shape[0]
        mine = slice(self.accelerator.process_index * n, (self.accelerator.process_index + 1) * n)
        acc, reason, total = (t[mine].to(device=adv.device) for t in (acc, reason, total))
        # Cheap guard that the split is TRL's advantage (same rows, groups and scaling).
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
        out["advantages_acc"] = acc.to(adv.dtype)
        out["advantages_reason"] = reason.to(adv.dtype)
        return out

    # -- 2. losses from one forward -------------------------------------------------------
    _pcgrad_forward: dict[str, Any] | None = None

    @contextlib.contextmanager
    def _pcgrad_one_forward(self):
        """Every ``_get_per_token_logps_and_entropies`` call inside returns the first one's
        result (graph included), so several losses share one forward."""
        self._pcgrad_forward = {}
        try:
            yield self._pcgrad_forward
        finally:
            self._pcgrad_forward = None

    def _get_per_token_logps_and_entropies(self, *args: Any, **kwargs: Any):
        """TRL's, or inside :meth:`_pcgrad_one_forward` the first call's result again."""
        cache = self._pcgrad_forward
        if cache is None:
            return super()._get_per_token_logps_and_entropies(*args, **kwargs)
        if "out" not in cache:
            with torch.enable_grad():
                cache["out"] = super()._get_per_token_logps_and_entropies(*args, **kwargs)
        return cache["out"]

    def pcgrad_losses(self, model, inputs) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """(plain GRPO loss, detached, with TRL's metrics logged; {accuracy, reasoning(, rest): loss}).

        All from ONE forward. accuracy / reasoning: TRL's surrogate with the objective's
        advantages and beta = 0, no entropy bonus, no aux loss. rest, only when any of those
        is on: the same call with zero advantages, so it holds exactly the KL penalty
        (+ entropy bonus + aux loss) with TRL's normalisation. The KL term is NOT projected:
        it is the trust region anchoring the policy to the reference for both objectives;
        projecting it against an objective would let that objective cancel the anchor. It is
        added after the projection. ``inputs`` flows into every call with only ``advantages``
        replaced, so any column TRL's loss reads (a mask) applies to every loss.
        """
        rest = self.beta != 0.0 or self._entropy_bonus_enabled or self.aux_loss_enabled
        with self._pcgrad_one_forward():
            before = dict(vars(self))
            with torch.no_grad():  # the forward inside still records its graph
                plain = super().compute_loss(model, inputs)
            after = dict(vars(self))  # what the plain call moved (the adaptive-entropy state) is the step's
            quiet = {"beta": 0.0, "_entropy_bonus_enabled": False, "aux_loss_enabled": False}
            # objective_inputs: the objective's own loss mask under dynamic_sampling.metric: objectives;
            # the per-token step term (reward.step_credit) is the reasoning objective's alone
            losses = {
                name: self._pcgrad_quiet_loss(
                    model,
                    {
                        **objective_inputs(inputs, name),
                        "advantages": inputs[key],
                        STEP_FIELD: inputs.get(STEP_FIELD) if name == REASONING else None,
                    },
                    before,
                    quiet,
                )
                for name, key in OBJECTIVE_ADVANTAGES.items()
            }
            if rest:
                zeros = torch.zeros_like(inputs["advantages"])
                losses[REST] = self._pcgrad_quiet_loss(
                    model, {**inputs, "advantages": zeros, STEP_FIELD: None}, before, {}
                )
            reset_attributes(self, after)
        return plain.detach(), losses

    def _pcgrad_quiet_loss(self, model, inputs, state: dict[str, Any], overrides: dict[str, Any]) -> torch.Tensor:
        """TRL's ``_compute_loss`` on the trainer as ``state`` left it (before the plain call: the
        adaptive-entropy controller not yet moved), with ``overrides``, logging nothing."""
        reset_attributes(self, state)
        for k, v in overrides.items():
            setattr(self, k, v)
        self._metrics = {"train": defaultdict(list), "eval": defaultdict(list)}
        return self._compute_loss(model, inputs)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if not self._pcgrad_in_step:
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        loss, self._pcgrad_pending = self.pcgrad_losses(model, inputs)
        return loss

    # -- 3. the training step: TRL's, with PCGrad's losses and backward passes -----------------
    def training_step(self, model, inputs, num_items_in_batch=None):
        if not self.pcgrad:
            return super().training_step(model, inputs, num_items_in_batch)
        # DDP: several backward passes through one DDP forward would confuse its reducer, so
        # all of it runs without DDP's hooks; the window averages the sums itself.
        with self.accelerator.no_sync(model), self._pcgrad_step(model):
            return super().training_step(model, inputs, num_items_in_batch)

    @contextlib.contextmanager
    def _pcgrad_step(self, model):
        """For one training step: ``compute_loss`` builds PCGrad's losses and
        ``accelerator.backward`` is :meth:`_pcgrad_backward`."""
        accelerator = vars(self.accelerator)
        saved = accelerator.get("backward", _MISSING)
        accelerator["backward"] = functools.partial(self._pcgrad_backward, model, self.accelerator.backward)
        self._pcgrad_in_step = True
        try:
            yield
        finally:
            self._pcgrad_in_step, self._pcgrad_pending = False, None
            if saved is _MISSING:
                del accelerator["backward"]
            else:
                accelerator["backward"] = saved

    def _pcgrad_backward(self, model, plain_backward: Callable[..., None], loss: torch.Tensor, **kwargs: Any) -> None:
        """Stands in for ``accelerator.backward(loss)`` (``loss``: the plain loss, detached): one
        backward pass per PCGrad loss into the window's sums; at the accumulation boundary the
        projected update is written and, under DeepSpeed, the engine's step taken."""
        losses, self._pcgrad_pending = self._pcgrad_pending, None
        if losses is None:
            raise RuntimeError("pcgrad: accelerator.backward was called without PCGrad's losses")
        started = time.perf_counter()
        if self._pcgrad_window is None:
            self._pcgrad_window = open_window(model, self.current_gradient_accumulation_steps, REST in losses)
        window, boundary = self._pcgrad_window, self.accelerator.sync_gradients
        names = window.order(losses)
        late = [losses[REST]] if REST in losses and REST not in names else []
        if late and not boundary:
            raise RuntimeError("pcgrad: a one-micro-step window must end at an accumulation boundary")
        spent: list[float] = []
        passes = self._pcgrad_backward_passes(model, plain_backward, [losses[n] for n in names] + late, spent)
        for name, run in zip(names, passes):
            window.accumulate(name, run)
        if boundary:
            stats = window.project(late_backward=passes[-1] if late else None)
            self._pcgrad_window = None
        # Extra cost over plain GRPO: the backward passes beyond the first one (their share of the
        # backward time) plus the swaps, reduction and projection.
        self._pcgrad_overhead += (time.perf_counter() - started) - sum(spent) / len(passes)
        if boundary:
            if is_deepspeed_engine(model):
                model.step()  # what accelerate's DeepSpeedEngineWrapper.backward does at the boundary
            stats["overhead_seconds"], self._pcgrad_overhead = self._pcgrad_overhead, 0.0
            for k, v in stats.items():
                self._metrics["train"][f"pcgrad/{k}"].append(v)

    def _pcgrad_backward_passes(
        self, model, plain_backward: Callable[..., None], losses: list[torch.Tensor], spent: list[float]
    ) -> list[Callable[[], None]]:
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
                    plain_backward(loss, retain_graph=retain)
                spent.append(time.perf_counter() - t)

            return run

        return [one(i, loss) for i, loss in enumerate(losses)]


class PCGradGRPOTrainer(PCGradMixin, CrystalGRPOTrainer):
    """The trainer of ``pcgrad: true`` runs (see :func:`trainer_class`)."""


def trainer_class(pcgrad: bool) -> type[CrystalGRPOTrainer]:
    """The trainer for a run: plain TRL plus our hooks, or its PCGrad subclass when asked for."""
    return PCGradGRPOTrainer if pcgrad else CrystalGRPOTrainer

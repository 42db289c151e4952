"""PCGrad (Yu et al. 2020) between the accuracy and the reasoning objectives (docs/method.md section 9).

``PCGradGRPOTrainer`` (``PCGradMixin`` over ``CrystalGRPOTrainer``) is the trainer of runs with
``pcgrad: true``; other runs never load these hooks. They rely on TRL's private methods, so
``pyproject.toml`` pins TRL's minor version and ``tests/test_trl_contract.py`` checks every
signature and behaviour used here. How it hooks into TRL's ``GRPOTrainer``:

1. ``_calculate_rewards``: keeps TRL's *global* ``rewards_per_func`` (all processes).
2. ``_generate_and_score_completions``: adds ``advantages_acc`` / ``advantages_reason``
   for this process's rows (:func:`objective_advantages`): per group, the summed
   components of each objective (``RewardModule.objectives``), centred by
   their own group mean and scaled by the group's std of the *total* reward, exactly as
   TRL scales its advantage, so ``advantages_acc + advantages_reason == advantages``
   (checked at run time). TRL then shuffles/splits these like every other column.
3. ``training_step``: ONE forward; from its per-token log-probs TRL's own
   ``_compute_loss`` builds the accuracy and the reasoning surrogate (same loss_type,
   clipping, importance sampling, masks; KL, entropy bonus and aux loss switched off)
   and, when any of these is on, a third loss holding only them. One backward pass per
   loss; the gradients are accumulated into flat fp32 buffers over the micro-steps.
4. At the accumulation boundary the buffers are reduced across processes, projected
   (docs/method.md section 9, dot products over every trainable parameter of every rank) and
   written back as ``.grad`` (or as the ZeRO-3 gradient partitions), so clipping, the
   optimizer and the non-finite guard run unchanged.

Exactness across topologies:
- one process: gradients read with plain ``backward``;
- DDP: forward/backwards run under ``no_sync`` (several backward passes through one DDP
  forward would confuse its reducer); the three flat buffers are averaged across ranks
  with one ``all_reduce`` (what DDP does), then every rank projects the same vectors;
- DeepSpeed ZeRO-3: each backward goes through the engine (it reduce-scatters into the
  rank's partition); the partition is read with ``safe_get_local_grad`` and zeroed; at
  the boundary the partial dot products and squared norms of the local slices are
  summed across ranks (one ``all_reduce`` of three numbers), so every rank applies the
  *global* projection coefficients to its slice; the result is written back with
  ``safe_set_local_grad`` before ``engine.step()``.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from collections import defaultdict
from typing import Any

import torch

from crystal_grpo.rewards.base import OBJECTIVES
from crystal_grpo.train.config import LIGER_REFUSED
from crystal_grpo.train.dynamic_sampling import objective_inputs
from crystal_grpo.train.trainer import CrystalGRPOTrainer

logger = logging.getLogger(__name__)

#: The TRL minor version these hooks were verified against (tests/test_trl_contract.py);
#: pyproject.toml pins it.
TESTED_TRL = "1.16"
#: Relative tolerance of the run-time check acc + reason == TRL's advantage.
SUM_CHECK_RTOL = 1e-3


# --------------------------------------------------------------------------- pure maths
def pcgrad_coefficients(dot: float, sq_acc: float, sq_reason: float, eps: float = 1e-12) -> tuple[float, float]:
    """(a, b) with combined = a g_acc + b g_reason (docs/method.md section 9).

    Conflict (dot < 0): g_acc' = g_acc - dot/|g_r|^2 g_r and g_r' = g_r - dot/|g_acc|^2 g_acc,
    so g_acc' + g_r' = (1 - dot/|g_acc|^2) g_acc + (1 - dot/|g_r|^2) g_r. Otherwise (1, 1).
    """
    if dot >= 0:
        return 1.0, 1.0
    return 1.0 - dot / max(sq_acc, eps), 1.0 - dot / max(sq_reason, eps)


def pcgrad_stats(dot: float, sq_acc: float, sq_reason: float, eps: float = 1e-12) -> dict[str, float]:
    """Logged quantities, from the three global scalars only (no extra communication)."""
    a, b = pcgrad_coefficients(dot, sq_acc, sq_reason, eps)
    na, nr = math.sqrt(max(sq_acc, 0.0)), math.sqrt(max(sq_reason, 0.0))
    plain_sq = sq_acc + 2 * dot + sq_reason
    diff_sq = (a - 1) ** 2 * sq_acc + 2 * (a - 1) * (b - 1) * dot + (b - 1) ** 2 * sq_reason
    return {
        "cosine": dot / max(na * nr, eps),
        "conflict": float(dot < 0),
        "norm_acc": na,
        "norm_reason": nr,
        # |combined - (g_acc + g_reason)| / |g_acc + g_reason| (the KL term is not part of either)
        "projected_fraction": math.sqrt(max(diff_sq, 0.0)) / max(math.sqrt(max(plain_sq, 0.0)), eps),
    }


def project_conflicting(g_acc: torch.Tensor, g_reason: torch.Tensor, eps: float = 1e-12
                        ) -> tuple[torch.Tensor, float]:
    """Combined update and cosine for two flat gradients.

    When they conflict (negative dot product) each is projected onto the normal plane of
    the *other's original* gradient, then they are summed; otherwise the plain sum.
    """
    dot = torch.dot(g_acc, g_reason)
    na, nr = g_acc.square().sum(), g_reason.square().sum()
    cos = float(dot / (na.sqrt() * nr.sqrt()).clamp(min=eps))
    if dot >= 0:
        return g_acc + g_reason, cos
    acc = g_acc - dot / nr.clamp(min=eps) * g_reason
    reason = g_reason - dot / na.clamp(min=eps) * g_acc
    return acc + reason, cos


def _nanstd(x: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """TRL's ``nanstd`` (Bessel-corrected, NaN-aware); NaN with fewer than two values."""
    from trl.trainer.utils import nanstd

    return nanstd(x, dim=dim) if dim is not None else nanstd(x)


def objective_advantages(
    rewards_per_func: torch.Tensor,
    objectives: list[str],
    reward_weights: torch.Tensor,
    num_generations: int,
    scale_rewards: str | bool = "group",
    objective_std: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-objective advantages of a *global* generation batch (float64).

    ``rewards_per_func``: ``[N, F]`` as gathered by TRL (rows in groups of
    ``num_generations``, NaN = not applicable); ``objectives[f]`` is ``"accuracy"`` or
    ``"reasoning"``. Returns ``(adv_acc, adv_reason, adv_total)``: ``adv_total`` is TRL's
    ``sum_then_normalize`` advantage recomputed; the two parts are each objective's
    weighted component sum (NaN components count as 0, like TRL's ``nansum``) minus its
    own group mean, divided by the same ``std + 1e-4`` of the total reward TRL uses
    (group or batch std per ``scale_rewards``; none: not divided). So
    ``adv_acc + adv_reason == adv_total``. Rows where every function returned None
    (unscorable) get 0, as in TRL. With ``objective_std`` each part is instead divided by
    its own std (same group/batch choice); the parts then no longer add up to TRL's.
    """
    scale_rewards = {True: "group", False: "none"}.get(scale_rewards, scale_rewards)  # as GRPOConfig reads it
    if scale_rewards not in ("group", "batch", "none"):
        raise ValueError(f"scale_rewards={scale_rewards!r}: expected 'group', 'batch' or 'none'")
    bad = [o for o in objectives if o not in OBJECTIVES]
    if bad or len(objectives) != rewards_per_func.shape[1]:
        raise ValueError(f"objectives {objectives!r}: need one of {OBJECTIVES} per reward function")
    r = rewards_per_func.double() * reward_weights.double().to(rewards_per_func.device).unsqueeze(0)
    unscorable = torch.isnan(rewards_per_func).all(dim=1)
    G = num_generations

    def part(cols: list[bool]) -> torch.Tensor:
        mask = torch.tensor(cols, dtype=torch.bool, device=r.device)
        s = r[:, mask].nansum(dim=1) if bool(mask.any()) else torch.zeros(len(r), dtype=r.dtype, device=r.device)
        s[unscorable] = torch.nan
        return s

    total = part([True] * len(objectives))
    parts = [part([o == k for o in objectives]) for k in OBJECTIVES]

    def std_of(x: torch.Tensor) -> torch.Tensor:
        if scale_rewards == "batch":
            return _nanstd(x).expand_as(x) if x.numel() > 1 else torch.zeros_like(x)
        if G > 1:
            return _nanstd(x.view(-1, G), dim=1).repeat_interleave(G)
        return torch.zeros_like(x)

    def centred(x: torch.Tensor) -> torch.Tensor:
        return x - torch.nanmean(x.view(-1, G), dim=1).repeat_interleave(G)

    std_total = std_of(total)
    out = []
    for x in [*parts, total]:
        adv = centred(x)
        if scale_rewards != "none":
            std = std_of(x) if (objective_std and x is not total) else std_total
            adv = adv / (std + 1e-4)
        out.append(torch.nan_to_num(adv, nan=0.0))
    return out[0], out[1], out[2]


# --------------------------------------------------------------------------- trainer hooks
def _is_deepspeed_engine(model: Any) -> bool:
    try:
        from deepspeed import DeepSpeedEngine
    except Exception:  # noqa: BLE001 - deepspeed optional
        return False
    return isinstance(model, DeepSpeedEngine)


#: Per-module counters ZeRO-3's backward hooks consume: ``applied_pre_backward_ref_cnt``
#: (re-gather the module's parameters before its backward) and ``ds_grads_remaining``
#: (release them after). One forward sets them for ONE backward; a second backward
#: through the retained graph would find them at 0 and run on released (empty)
#: parameters. Restoring the post-forward values lets each backward gather again.
_ZERO3_COUNTERS = ("applied_pre_backward_ref_cnt", "ds_grads_remaining")


def _zero3_backward_counters(engine) -> list[tuple[torch.nn.Module, str, int]]:
    return [(m, k, m.__dict__[k]) for m in engine.module.modules() for k in _ZERO3_COUNTERS if k in m.__dict__]


def _restore_counters(counters: list[tuple[torch.nn.Module, str, int]]) -> None:
    for m, k, v in counters:
        m.__dict__[k] = v


class PCGradMixin:
    """PCGrad hooks for ``GRPOTrainer`` (see the module docstring).

    ``pcgrad_objective_std``: divide each objective's advantage by its own std instead of the
    total's. ``self.pcgrad`` may be switched off between steps (benchmarks compare both in
    one trainer); off, every hook defers to plain TRL GRPO.
    """

    def __init__(self, *args: Any, pcgrad_objective_std: bool = False, **kwargs: Any) -> None:
        self.pcgrad, self.pcgrad_objective_std = True, pcgrad_objective_std
        training_args = kwargs.get("args", args[2] if len(args) > 2 else None)
        if getattr(training_args, "use_liger_kernel", False):  # before TRL patches the model with them
            raise ValueError(LIGER_REFUSED)
        super().__init__(*args, **kwargs)
        self._pcgrad_rewards = None
        self._pcgrad_buf: torch.Tensor | None = None
        self._pcgrad_layout: tuple | None = None
        self._pcgrad_window_open = False
        self._pcgrad_rows = 0
        self._pcgrad_overhead = 0.0
        self._pcgrad_check_supported()

    # -- configuration checks ----------------------------------------------------------
    def _pcgrad_objectives(self) -> list[str]:
        """The objective of each of TRL's reward columns (``CrystalGRPOTrainer.reward_objectives``)."""
        untagged = [n for n, o in zip(self.reward_func_names, self.reward_objectives) if o is None]
        if untagged:
            raise ValueError(f"pcgrad: reward function(s) {untagged} have no objective; tag every reward function "
                             "with reward_objectives=['accuracy', 'reasoning', ...] (one per function) or a "
                             "function attribute fn.objective = 'accuracy' | 'reasoning'")
        return list(self.reward_objectives)

    def _pcgrad_check_supported(self) -> None:
        import trl
        from accelerate.utils import DistributedType

        if not trl.__version__.startswith(TESTED_TRL + "."):
            logger.warning("pcgrad: TRL %s is installed, but PCGrad's hooks into TRL internals were verified "
                           "against TRL %s.x only (tests/test_trl_contract.py); run that test first",
                           trl.__version__, TESTED_TRL)

        if self.multi_objective_aggregation != "sum_then_normalize":
            raise ValueError(
                "pcgrad: true supports multi_objective_aggregation='sum_then_normalize' only (the objective "
                f"advantages are defined as parts of that sum); got {self.multi_objective_aggregation!r}.")
        objs = self._pcgrad_objectives()
        if len(set(objs)) < 2:
            logger.warning("pcgrad: every reward function serves %r; the other objective's gradient is zero "
                           "and PCGrad reduces to plain GRPO", objs[0] if objs else None)
        dt = self.accelerator.distributed_type
        if dt == DistributedType.DEEPSPEED:
            stage = self.accelerator.state.deepspeed_plugin.zero_stage
            if stage != 3:
                raise NotImplementedError(
                    f"pcgrad under DeepSpeed ZeRO-{stage}: only ZeRO-3 is supported (its gradient partitions are "
                    "read and written per parameter with deepspeed.utils.safe_get_local_grad / "
                    "safe_set_local_grad, which exist for ZeRO-3 only). Use ZeRO-3, DDP, or pcgrad: false.")
            zcfg = self.accelerator.state.deepspeed_plugin.deepspeed_config.get("zero_optimization", {})
            if (zcfg.get("offload_optimizer") or {}).get("device", "none") not in ("none", None):
                raise NotImplementedError(
                    "pcgrad with ZeRO-3 optimizer offload: the offloaded gradient buffer is only filled at the "
                    "accumulation boundary, so per-objective gradients cannot be separated; disable "
                    "offload_optimizer or set pcgrad: false.")
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
            rewards, self._pcgrad_objectives(), self.reward_weights, self.num_generations,
            self.scale_rewards, self.pcgrad_objective_std)
        adv = out["advantages"]
        n = adv.shape[0]
        mine = slice(self.accelerator.process_index * n, (self.accelerator.process_index + 1) * n)
        acc, reason, total = (t[mine].to(device=adv.device) for t in (acc, reason, total))
        # Cheap guard that the split is TRL's advantage (same rows, groups and scaling).
        scale = 1.0 + adv.abs().max().item() if n else 1.0
        err = (total - adv.double()).abs().max().item() if n else 0.0
        if err > SUM_CHECK_RTOL * scale:
            raise RuntimeError(f"pcgrad: recomputed advantages differ from TRL's by {err:.3g}; the objective "
                               "split would not add up to the GRPO advantage")
        if not self.pcgrad_objective_std:
            err = (acc + reason - adv.double()).abs().max().item() if n else 0.0
            if err > SUM_CHECK_RTOL * scale:
                raise RuntimeError(f"pcgrad: advantages_acc + advantages_reason differ from TRL's advantage by "
                                   f"{err:.3g}")
        out["advantages_acc"] = acc.to(adv.dtype)
        out["advantages_reason"] = reason.to(adv.dtype)
        return out

    # -- 2. losses from one forward -------------------------------------------------------
    @contextlib.contextmanager
    def _pcgrad_one_forward(self):
        """Every ``_get_per_token_logps_and_entropies`` call inside returns the first one's
        result (graph included), so several losses share one forward."""
        cache: dict[str, Any] = {}
        original = self._get_per_token_logps_and_entropies

        def shared(*args: Any, **kwargs: Any):
            if "out" not in cache:
                with torch.enable_grad():
                    cache["out"] = original(*args, **kwargs)
            return cache["out"]

        self._get_per_token_logps_and_entropies = shared
        try:
            yield cache
        finally:
            del self._get_per_token_logps_and_entropies

    _STATE_ATTRS = ("entropy_coef", "_last_world_entropy", "_entropy_window_stats")

    @contextlib.contextmanager
    def _pcgrad_quiet(self, **overrides: Any):
        """Run ``_compute_loss`` without logging metrics or moving the adaptive-entropy
        controller (the plain call already did both), with some attributes overridden."""
        saved = {k: getattr(self, k) for k in (*self._STATE_ATTRS, *overrides) if hasattr(self, k)}
        metrics = self._metrics
        self._metrics = {"train": defaultdict(list), "eval": defaultdict(list)}
        try:
            for k, v in overrides.items():
                setattr(self, k, v)
            yield
        finally:
            self._metrics = metrics
            for k, v in saved.items():
                setattr(self, k, v)

    def pcgrad_losses(self, model, inputs) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """(plain GRPO loss, detached, with TRL's metrics logged; [L_acc, L_reason(, L_rest)]).

        All from ONE forward. L_acc / L_reason: TRL's surrogate with the objective's
        advantages and beta = 0, no entropy bonus, no aux loss. L_rest, only when any of
        those is on: the same call with zero advantages, so it holds exactly the KL
        penalty (+ entropy bonus + aux loss) with TRL's normalisation. The KL term is NOT
        projected: it is the trust region anchoring the policy to the reference for both
        objectives; projecting it against an objective would let that objective cancel
        the anchor. It is added back after the projection (``pcgrad_apply``).
        """
        snapshot = lambda: {k: getattr(self, k) for k in self._STATE_ATTRS if hasattr(self, k)}  # noqa: E731
        with self._pcgrad_one_forward():
            state_before = snapshot()
            with torch.no_grad():  # the forward inside still records its graph
                plain = self.compute_loss(model, inputs)
            state_after = snapshot()
            # The plain call moved the adaptive-entropy state; the other losses must see the old one.
            for k, v in state_before.items():
                setattr(self, k, v)
            losses = []
            with self._pcgrad_quiet(beta=0.0, _entropy_bonus_enabled=False, aux_loss_enabled=False):
                for key, objective in (("advantages_acc", "accuracy"), ("advantages_reason", "reasoning")):
                    # objective_inputs: the objective's own loss mask with dynamic_sampling.metric: objectives
                    losses.append(self._compute_loss(model, {**objective_inputs(inputs, objective),
                                                             "advantages": inputs[key]}))
            if self.beta != 0.0 or self._entropy_bonus_enabled or self.aux_loss_enabled:
                with self._pcgrad_quiet():
                    zeros = torch.zeros_like(inputs["advantages"])
                    losses.append(self._compute_loss(model, {**inputs, "advantages": zeros}))
            for k, v in state_after.items():
                setattr(self, k, v)
        return plain.detach(), losses

    # -- 3. backward passes into flat per-objective buffers --------------------------------
    def _pcgrad_params(self, model) -> tuple[list[torch.nn.Parameter], list[int], bool]:
        """Trainable parameters, the size each contributes to the flat buffers on this rank
        (the local ZeRO-3 partition under DeepSpeed), and whether this is ZeRO-3."""
        zero3 = _is_deepspeed_engine(model)
        if self._pcgrad_layout is None or self._pcgrad_layout[0] is not model:
            params = [p for p in model.parameters() if p.requires_grad]
            sizes = [p.ds_tensor.numel() if zero3 else p.numel() for p in params]
            self._pcgrad_layout = (model, params, sizes, zero3)
        return self._pcgrad_layout[1], self._pcgrad_layout[2], self._pcgrad_layout[3]

    def _pcgrad_harvest(self, params, sizes, zero3: bool, row: torch.Tensor) -> None:
        """Add this rank's freshly computed gradient to ``row`` and clear it at the source."""
        off = 0
        if zero3:
            from deepspeed.utils import safe_get_local_grad

            for p, n in zip(params, sizes):
                g = safe_get_local_grad(p)  # the partition buffer itself (no offload)
                if g is not None:
                    row[off:off + n].add_(g.reshape(-1))
                    g.zero_()
                off += n
        else:
            for p, n in zip(params, sizes):
                if p.grad is not None:
                    row[off:off + n].add_(p.grad.reshape(-1))
                    p.grad = None
                off += n

    def pcgrad_backward(self, model, losses: list[torch.Tensor]) -> None:
        """One backward pass per loss, each gradient accumulated into its own buffer row."""
        params, sizes, zero3 = self._pcgrad_params(model)
        total = sum(sizes)
        device = params[0].device if params else torch.device("cpu")
        if self._pcgrad_buf is None or self._pcgrad_buf.shape[1] != total or self._pcgrad_buf.device != device:
            self._pcgrad_buf = torch.zeros(3, total, dtype=torch.float32, device=device)
            self._pcgrad_window_open = False
        if not self._pcgrad_window_open:
            self._pcgrad_buf.zero_()
            self._pcgrad_rows = 0
            self._pcgrad_window_open = True
            if zero3:  # a partition no backward writes to would still hold the last update
                from deepspeed.utils import safe_get_local_grad

                for p in params:
                    g = safe_get_local_grad(p)
                    if g is not None:
                        g.zero_()
        self._pcgrad_rows = max(self._pcgrad_rows, len(losses))
        if not zero3:
            # Gradients already sitting in .grad (none in the normal loop) stay out of the projection.
            for p in params:
                if p.grad is not None:
                    raise RuntimeError("pcgrad: parameters already hold gradients before the PCGrad backward")
        counters = _zero3_backward_counters(model) if zero3 else None
        for i, loss in enumerate(losses):
            retain = i < len(losses) - 1
            if zero3:
                if i:
                    _restore_counters(counters)
                model.set_gradient_accumulation_boundary(is_boundary=self.accelerator.sync_gradients)
                model.backward(loss, retain_graph=retain, scale_wrt_gas=False)  # loss already scaled (TRL)
            elif self.accelerator.scaler is not None:
                self.accelerator.scaler.scale(loss).backward(retain_graph=retain)
            else:
                loss.backward(retain_graph=retain)
            self._pcgrad_harvest(params, sizes, zero3, self._pcgrad_buf[i])

    # -- 4. projection at the accumulation boundary --------------------------------------
    def pcgrad_apply(self, model) -> dict[str, float]:
        """Reduce, project and write back the accumulated gradients (once per update)."""
        import torch.distributed as dist

        params, sizes, zero3 = self._pcgrad_params(model)
        buf = self._pcgrad_buf[: self._pcgrad_rows]
        self._pcgrad_window_open = False
        distributed = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
        if distributed and not zero3:
            dist.all_reduce(buf)  # DDP semantics: gradients averaged over ranks
            buf.div_(dist.get_world_size())
        g_acc, g_reason = buf[0], buf[1]
        partial = torch.stack([torch.dot(g_acc, g_reason), torch.dot(g_acc, g_acc),
                               torch.dot(g_reason, g_reason)]).double()
        if distributed and zero3:
            dist.all_reduce(partial)  # each rank holds a slice: global dot products = sum of partial ones
        dot, sq_acc, sq_reason = partial.tolist()
        a, b = pcgrad_coefficients(dot, sq_acc, sq_reason)
        combined = g_acc * a + g_reason * b if (a, b) != (1.0, 1.0) else g_acc + g_reason
        if buf.shape[0] > 2:
            combined += buf[2]  # KL (+ entropy bonus, aux loss): never projected, see pcgrad_losses
        off = 0
        if zero3:
            from deepspeed.utils import safe_set_local_grad

            for p, n in zip(params, sizes):
                safe_set_local_grad(p, combined[off:off + n])
                off += n
        else:
            for p, n in zip(params, sizes):
                g = combined[off:off + n].view_as(p).to(p.dtype)
                p.grad = g if p.grad is None else p.grad + g
                off += n
        return pcgrad_stats(dot, sq_acc, sq_reason)

    # -- the training step ------------------------------------------------------------------
    def training_step(self, model, inputs, num_items_in_batch=None):
        if not self.pcgrad:
            return super().training_step(model, inputs, num_items_in_batch)
        # Same bookkeeping as TRL's training_step + HF's (train mode, inputs, loss scale).
        time_before = time.perf_counter()
        model.train()
        if hasattr(self.optimizer, "train") and callable(self.optimizer.train):
            self.optimizer.train()
        inputs = self._prepare_inputs(inputs)
        # DDP: several backward passes through one DDP forward would confuse its reducer, so
        # all of it runs without DDP's hooks; pcgrad_apply averages the buffers itself.
        with self.compute_loss_context_manager(), self.accelerator.no_sync(model):
            loss, losses = self.pcgrad_losses(model, inputs)
            t1 = time.perf_counter()
            self.pcgrad_backward(model, losses)
            t2 = time.perf_counter()
        # Extra cost over plain GRPO, estimated as the backward passes beyond the first one
        # (their share of the backward time) plus the reduction/projection below.
        self._pcgrad_overhead += (t2 - t1) * (len(losses) - 1) / len(losses)
        del inputs
        if self.accelerator.sync_gradients:
            t3 = time.perf_counter()
            stats = self.pcgrad_apply(model)
            self._pcgrad_overhead += time.perf_counter() - t3
            if _is_deepspeed_engine(model):
                model.step()  # what accelerate's DeepSpeedEngineWrapper.backward does at the boundary
            stats["overhead_seconds"] = self._pcgrad_overhead
            self._pcgrad_overhead = 0.0
            for k, v in stats.items():
                self._metrics["train"][f"pcgrad/{k}"].append(v)
        # TRL's training_step bookkeeping (its generation buffer is indexed by _step).
        self._step += 1
        self._current_train_step_time += time.perf_counter() - time_before
        if self._step % self.current_gradient_accumulation_steps == 0:
            self._metrics["train"]["step_time"].append(self._current_train_step_time)
            self._current_train_step_time = 0.0
        return loss


class PCGradGRPOTrainer(PCGradMixin, CrystalGRPOTrainer):
    """The trainer of ``pcgrad: true`` runs (see :func:`trainer_class`)."""


def trainer_class(pcgrad: bool) -> type[CrystalGRPOTrainer]:
    """The trainer for a run: plain TRL plus our hooks, or its PCGrad subclass when asked for."""
    return PCGradGRPOTrainer if pcgrad else CrystalGRPOTrainer

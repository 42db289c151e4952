"""PCGrad's mathematics (docs/method.md section 9): the projection of two gradients, its
coefficients and logged statistics, and the per-objective advantages it projects between.

Plain functions on tensors and numbers; the gradient plumbing is train/pcgrad/gradients.py,
the TRL hooks train/pcgrad/trainer.py.
"""

from __future__ import annotations

import math

import torch

from crystal_grpo.rewards.base import OBJECTIVES
from crystal_grpo.train.trainer.groups import group_flat, nanstd, weighted_reward


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


def project_conflicting(g_acc: torch.Tensor, g_reason: torch.Tensor, eps: float = 1e-12) -> tuple[torch.Tensor, float]:
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


def objective_advantages(
    rewards_per_func: torch.Tensor,
    objectives: list[str],
    reward_weights: torch.Tensor,
    num_generations: int,
    scale_rewards: str | bool = "group",
    objective_std: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-objective advantages of a *global* generation batch (float64).

    ``rewards_per_func``: ``[N, F]`` as gathered by TRL (rows in groups of ``num_generations``,
    NaN = not applicable); ``objectives[f]`` is ``"accuracy"`` or ``"reasoning"``. Returns
    ``(adv_acc, adv_reason, adv_total)``: ``adv_total`` is TRL's ``sum_then_normalize``
    advantage recomputed; each part is its objective's weighted component sum (NaN as 0, like
    TRL's ``nansum``) minus its group mean, over the total reward's ``std + 1e-4`` as TRL
    scales (per ``scale_rewards``), so ``adv_acc + adv_reason == adv_total``. Unscorable rows
    get 0, as in TRL. A group with a flat total (``group_flat``, train/trainer/groups.py) gets half
    its total advantage in each part, not parts of ~1e4 times their deviations
    (docs/training.md, "PCGrad"). With ``objective_std`` each part is divided by its own std
    instead; the parts then no longer add up to TRL's.
    """
    scale_rewards = {True: "group", False: "none"}.get(scale_rewards, scale_rewards)  # as GRPOConfig reads it
    if scale_rewards not in ("group", "batch", "none"):
        raise ValueError(f"scale_rewards={scale_rewards!r}: expected 'group', 'batch' or 'none'")
    bad = [o for o in objectives if o not in OBJECTIVES]
    if bad or len(objectives) != rewards_per_func.shape[1]:
        raise ValueError(f"objectives {objectives!r}: need one of {OBJECTIVES} per reward function")
    G = num_generations
    total = weighted_reward(rewards_per_func, reward_weights, [True] * len(objectives))
    parts = [weighted_reward(rewards_per_func, reward_weights, [o == k for o in objectives]) for k in OBJECTIVES]

    def std_of(x: torch.Tensor) -> torch.Tensor:
        if scale_rewards == "batch":
            return nanstd(x).expand_as(x) if x.numel() > 1 else torch.zeros_like(x)
        if G > 1:
            return nanstd(x.view(-1, G), dim=1).repeat_interleave(G)
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
    acc, reason, adv_total = out
    if not objective_std and G > 1:
        flat = group_flat(total, G).repeat_interleave(G)
        acc, reason = (torch.where(flat, adv_total / 2, x) for x in (acc, reason))
    return acc, reason, adv_total

"""The group maths the trainer reads: a reward's weighted sum over TRL's ``[N, F]`` columns, and which
groups (one prompt's completions) are flat. Dynamic sampling and PCGrad's objective split share these,
so a group is flat by one rule for both."""

from __future__ import annotations

from collections.abc import Sequence

import torch

#: A group whose reward's std is at most this is flat (for dynamic sampling and PCGrad's split): float32
#: rounding of rewards of order 1 (what TRL holds them in) leaves a few 1e-8, far below it.
FLAT_TOTAL_STD = 1e-6


def nanstd(x: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """TRL's ``nanstd`` (Bessel-corrected, NaN-aware); NaN with fewer than two values."""
    from trl.trainer.utils import nanstd

    return nanstd(x, dim=dim) if dim is not None else nanstd(x)


def weighted_reward(rewards_per_func: torch.Tensor, weights: torch.Tensor, columns: Sequence[bool]) -> torch.Tensor:
    """``[N]`` float64: the weighted sum of the chosen columns of TRL's ``[N, F]`` rewards, NaN
    (not applicable) counting 0 as in TRL's ``nansum``; NaN on rows no function scored. The
    total reward with every column, an objective's part with its own."""
    r = rewards_per_func.double() * weights.double().to(rewards_per_func.device).unsqueeze(0)
    mask = torch.tensor(list(columns), dtype=torch.bool, device=r.device)
    s = r[:, mask].nansum(dim=1) if bool(mask.any()) else torch.zeros(len(r), dtype=r.dtype, device=r.device)
    s[torch.isnan(rewards_per_func).all(dim=1)] = torch.nan
    return s


def group_flat(values: torch.Tensor, num_generations: int, min_std: float = 0.0) -> torch.Tensor:
    """``[N]`` rewards in groups of ``num_generations`` -> ``[N / G]`` bool: the group's std is at
    most ``min_std`` or :data:`FLAT_TOTAL_STD` (NaN, a group with fewer than two scored rows: flat).
    The one rule for PCGrad's objective split and for dynamic sampling."""
    std = nanstd(values.view(-1, num_generations), dim=1)
    return ~(std > max(min_std, FLAT_TOTAL_STD))

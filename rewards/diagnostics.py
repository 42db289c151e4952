"""What a reward's numbers say about a batch (docs/method.md section 6): the reward as the sum of
its components, and the diagnostics logged every training step (accuracy, format rate, step
counts, the guard's rate, the rows whose steps the cap left unscored, the discrimination gap, the
reward's correlation with Match F1, the spread of the step scores)."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from crystal_grpo.rewards.batch import MAX_SCORED_STEPS

if TYPE_CHECKING:
    import torch

    from crystal_grpo.rewards.batch import Batch


def nanmean(t: torch.Tensor) -> float:
    """The mean of the defined (non-NaN) values; NaN when there are none."""
    known = t[~t.isnan()]
    return float(known.mean()) if len(known) else math.nan


def total(comps: dict[str, torch.Tensor], n: int) -> torch.Tensor:
    """The reward: the sum of the components, a not-applicable (NaN) component counting 0."""
    import torch

    return torch.stack(list(comps.values())).nansum(dim=0) if comps else torch.zeros(n, dtype=torch.float64)


def pearson(x: torch.Tensor, y: torch.Tensor) -> float:
    if len(x) < 2:
        return math.nan
    x, y = x - x.mean(), y - y.mean()
    denom = (x.square().sum() * y.square().sum()).sqrt()
    return float((x * y).sum() / denom) if denom > 0 else math.nan


def diagnostics(batch: Batch, comps: dict[str, torch.Tensor], flagged: torch.Tensor) -> dict[str, float]:
    """docs/method.md section 6 diagnostics over the global batch (NaN where undefined)."""
    reward = total(comps, len(batch))
    c = batch.correct.bool()
    refs = batch.has_refs.bool()
    mean = lambda t: float(t.mean()) if len(t) else math.nan
    out = {
        "accuracy": mean(batch.correct),
        "format_rate": mean(batch.format_ok),
        "steps_mean": mean(batch.n_pred),
        "steps_median": float(batch.n_pred.median()) if len(batch) else math.nan,
        "guard_rate": mean(flagged.double()),
        "discrimination_gap": mean(reward[c]) - mean(reward[~c]),
    }
    scored = ~batch.f1.isnan()  # the rows whose steps were scored (a reward that scores none caps none)
    out["steps_capped"] = float((batch.n_pred[scored] > MAX_SCORED_STEPS).sum())
    if bool(refs.any()):
        for f in ("precision", "recall", "f1", "lis_ratio", "ordered_f1"):
            out[f] = mean(getattr(batch, f)[refs])
        # the batch's spread of step scores: the composite's step term weighs F1 by alpha / f1_std
        out["f1_std"] = float(batch.step[refs].std(unbiased=False))
        out["r_f1"] = pearson(reward[refs], batch.step[refs])
    return out

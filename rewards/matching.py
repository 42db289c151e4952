"""Batched step matching on padded similarity tensors (docs/method.md sections 3, 4 and 11).

Everything here works on a whole batch at once: ``sim`` is ``[B, N, M]`` (predicted
steps x reference steps, cosine similarities), ``valid`` marks the real (unpadded)
entries. No Python loop runs over examples or pairs; the loops that remain run over
matching rounds or matrix rows, so their length is bounded by the step counts.
"""

from __future__ import annotations

import torch


def greedy_match(sim: torch.Tensor, valid: torch.Tensor, threshold: float) -> torch.Tensor:
    """Greedy 1:1 assignment of docs/method.md section 3, batched; returns a bool ``[B, N, M]`` mask.

    Paper order: pairs with ``sim >= threshold`` in descending similarity, ties by lower
    prediction index then lower reference index, accepted when both steps are still free.
    Rather than walking that order pair by pair, each round accepts every pair that comes
    first (in that order) among all free pairs of its own row and its own column. Such a
    "locally dominant" pair is exactly one the sequential greedy would accept, so the
    result is identical, and a round usually settles most rows at once.

    Within a row the paper order is (descending sim, lower k) and within a column
    (descending sim, lower j): exactly what ``max(dim).indices`` returns, since it picks
    the first maximal index on ties (documented). So no sort and no rank tensor is needed;
    each round costs two max-reductions and two in-place fills over the examples that
    still have free candidate pairs.
    """
    B, N, M = sim.shape
    matched = torch.zeros_like(valid)
    if N == 0 or M == 0:
        return matched
    # Free candidate pairs keep their similarity; the rest (and taken rows/columns) hold -inf.
    free = sim.masked_fill(~(valid & (sim >= threshold)), float("-inf"))
    row_ids = torch.arange(N, device=sim.device).expand(B, N)
    match_col = torch.full((B, N), -1, dtype=torch.long, device=sim.device)
    active = torch.arange(B, device=sim.device)  # examples still being matched
    while True:
        best, k = free.max(dim=2)  # each row's first free pair in paper order, [b, N]
        alive = best > float("-inf")
        live = alive.any(dim=1)
        if not bool(live.any()):
            break
        if not bool(live.all()):  # drop finished examples: later rounds touch only the rest
            keep = live.nonzero().squeeze(1)
            free, k, alive, active = free[keep], k[keep], alive[keep], active[keep]
        b = len(active)
        dominant = alive & (free.max(dim=1).indices.gather(1, k) == row_ids[:b])  # first in its column too
        match_col[active] = torch.where(dominant, k, match_col[active])
        free.masked_fill_(dominant.unsqueeze(2), float("-inf"))
        taken = torch.zeros(b, M, dtype=torch.int32, device=sim.device).scatter_add_(1, k, dominant.int())
        free.masked_fill_((taken > 0).unsqueeze(1), float("-inf"))
    hit = match_col >= 0
    return matched.scatter_(2, match_col.clamp(min=0).unsqueeze(2), hit.unsqueeze(2))


def monotonic_dp(weights: torch.Tensor) -> torch.Tensor:
    """Order-preserving DP table (StepSTEM Eq. 4) for a batch of ``[B, R, C]`` weights.

    ``dp[i][j] = max(dp[i-1][j], dp[i][j-1], dp[i-1][j-1] + w[i-1][j-1])``. For one row
    the ``dp[i][j-1]`` term is a running maximum, so each row is one ``cummax``.
    Returns the ``[B, R+1, C+1]`` table.
    """
    B, R, C = weights.shape
    dp = weights.new_zeros(B, R + 1, C + 1)
    for i in range(1, R + 1):
        prev = dp[:, i - 1]
        best = prev.clone()
        best[:, 1:] = torch.maximum(prev[:, 1:], prev[:, :-1] + weights[:, i - 1])
        dp[:, i] = torch.cummax(best, dim=1).values
    return dp


def dp_match(sim: torch.Tensor, valid: torch.Tensor, threshold: float) -> torch.Tensor:
    """Order-preserving 1:1 matching: the monotone alignment maximising summed similarity.

    Similarities below the threshold count as 0 (docs/method.md section 11) and a zero-weight cell
    is never a match. Backtracking from the bottom-right corner (padding has weight 0,
    so it never changes the optimum) prefers a diagonal step whenever it is optimal,
    then moving up a prediction, then left a reference. Returns a bool ``[B, N, M]`` mask.
    """
    B, N, M = sim.shape
    matched = torch.zeros_like(valid)
    if N == 0 or M == 0:
        return matched
    w = torch.where(valid & (sim >= threshold), sim, torch.zeros_like(sim))
    dp = monotonic_dp(w)
    batch = torch.arange(B, device=sim.device)
    i = torch.full((B,), N, dtype=torch.long, device=sim.device)
    j = torch.full((B,), M, dtype=torch.long, device=sim.device)
    for _ in range(N + M):
        active = (i > 0) & (j > 0)
        if not bool(active.any()):
            break
        ii, jj = (i - 1).clamp(min=0), (j - 1).clamp(min=0)
        here = dp[batch, i, j]
        cell = w[batch, ii, jj]
        diag = active & (cell > 0) & (here == dp[batch, ii, jj] + cell)
        up = active & ~diag & (here == dp[batch, ii, j])
        left = active & ~diag & ~up
        matched[batch[diag], ii[diag], jj[diag]] = True
        i = i - (diag | up).long()
        j = j - (diag | left).long()
    return matched


def longest_chain(matched: torch.Tensor) -> torch.Tensor:
    """LIS of docs/method.md section 4 for a batch of 1:1 match masks, as ``[B]`` int64.

    Reading prediction indices in reference order and taking the longest strictly
    increasing subsequence is the same as the longest chain of matched cells that
    increases in both coordinates: the monotone DP on the 0/1 mask, exact in integers.
    """
    if matched.shape[1] == 0 or matched.shape[2] == 0:
        return torch.zeros(matched.shape[0], dtype=torch.long, device=matched.device)
    return monotonic_dp(matched.int())[:, -1, -1].long()  # int32 ops are faster on CPU

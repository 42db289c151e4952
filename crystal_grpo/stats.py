"""Intervals for comparing trained arms that respect both sources of variance: the rows a
metric is averaged over, and the training seed.

Bootstrapping rows alone (seeds averaged first) treats one training run as if it were the
arm: two arms whose seeds scatter by 0.05 can then look different at 95% with three seeds
each. :func:`two_level_ci` resamples seeds, then rows (a hierarchical bootstrap, paired by
row across arms); :func:`seed_test` is the per-seed Welch test on the seed means beside it, with
its t-interval (near its nominal coverage with few seeds, where the percentile bootstrap of three
seeds runs short), :func:`holm` corrects a family of such tests, :func:`seeds_needed` says
how many seeds a difference of the observed size would need, and :func:`detectable_difference`
the smallest difference a planned number of seeds can find (a power analysis before a sweep).
With 5-10 seeds an arm the normal theory behind Welch is a hope: :func:`permutation_test` is exact
on the per-seed values, and :func:`fisher_test` / :func:`fisher_power` read a per-seed yes/no outcome
(does this run hold the chain?) by Fisher's exact test. :func:`contrast_rows` reads a sweep's
pre-registered contrasts with them, Holm-corrected within each family.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np


def nanmean(x: np.ndarray, axis=0):
    """Means ignoring NaN; an all-NaN slice is NaN without numpy's warning."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        return np.nanmean(x, axis=axis)


def _percentiles(samples: np.ndarray, level: float) -> tuple[np.ndarray, np.ndarray]:
    tail = (1 - level) / 2 * 100
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        return np.nanpercentile(samples, tail, axis=0), np.nanpercentile(samples, 100 - tail, axis=0)


def bootstrap_ci(values: np.ndarray, resamples: int, seed: int, level: float = 0.95) -> tuple[np.ndarray, np.ndarray]:
    """Percentile interval of the column means over ``resamples`` resamplings of the rows
    (one evaluation: the data's variance only)."""
    n = values.shape[0]
    if n == 0 or resamples <= 0:
        nan = np.full(values.shape[1:], np.nan)
        return nan, nan
    rng = np.random.default_rng(seed)
    return _percentiles(np.stack([nanmean(values[rng.integers(0, n, n)]) for _ in range(resamples)]), level)


def two_level_ci(
    a: np.ndarray, b: np.ndarray, resamples: int, seed: int, level: float = 0.95
) -> tuple[np.ndarray, np.ndarray]:
    """Interval of mean(b) - mean(a) for arms given as ``[seeds, rows, metrics]`` arrays on the
    same rows: each resample draws each arm's seeds with replacement, then one set of rows
    (the same for both arms: paired by row), and takes the difference of the means."""
    if a.ndim != 3 or b.ndim != 3 or a.shape[1:] != b.shape[1:]:
        raise ValueError(f"arms must be [seeds, rows, metrics] on the same rows, got {a.shape} and {b.shape}")
    rows = a.shape[1]
    if rows == 0 or resamples <= 0:
        nan = np.full(a.shape[2:], np.nan)
        return nan, nan
    rng = np.random.default_rng(seed)
    diffs = []
    for _ in range(resamples):
        sa, sb = rng.integers(0, a.shape[0], a.shape[0]), rng.integers(0, b.shape[0], b.shape[0])
        r = rng.integers(0, rows, rows)
        diffs.append(nanmean(nanmean(b[sb][:, r]), axis=0) - nanmean(nanmean(a[sa][:, r]), axis=0))
    return _percentiles(np.stack(diffs), level)


@dataclass
class SeedTest:
    """Welch's t-test on the per-seed means of two arms, its 95% t-interval of the difference,
    and the seeds a difference of this size would need for 80% power at the 5% level (two-sided)."""

    diff: float
    t: float | None
    df: float | None
    p: float | None
    seeds_needed: int | None
    low: float | None = None
    high: float | None = None


def seeds_needed(diff: float, sd: float, alpha: float = 0.05, power: float = 0.8) -> int | None:
    """Seeds per arm for a two-sided two-sample test at ``alpha`` to find ``diff`` with chance
    ``power``, given the seed-to-seed standard deviation ``sd`` (normal approximation). In a family
    read with Holm, ``alpha`` is the threshold the contrast faces (0.05 / m at the first step)."""
    from scipy.stats import norm

    if not (math.isfinite(diff) and math.isfinite(sd)) or diff == 0:
        return None
    z = norm.ppf(1 - alpha / 2) + norm.ppf(power)
    return max(2, math.ceil(2 * (z * sd / diff) ** 2))


def detectable_difference(sd_a: float, sd_b: float, seeds: int, alpha: float = 0.05, power: float = 0.8) -> float:
    """The smallest true difference Welch's two-sided test at ``alpha`` finds with chance ``power``
    when each arm has ``seeds`` seeds scattering by ``sd_a`` and ``sd_b`` (t quantiles at the
    Welch-Satterthwaite degrees of freedom: with few seeds the normal approximation is too hopeful)."""
    from scipy.stats import t

    if seeds < 2 or not (0 < alpha < 1 and 0 < power < 1):
        raise ValueError(f"need seeds >= 2 and alpha, power in (0, 1), got {seeds}, {alpha}, {power}")
    va, vb = sd_a**2 / seeds, sd_b**2 / seeds
    if va + vb == 0:
        return 0.0
    df = (va + vb) ** 2 / ((va**2 + vb**2) / (seeds - 1))
    return float((t.ppf(1 - alpha / 2, df) + t.ppf(power, df)) * math.sqrt(va + vb))


def seed_test(a: Sequence[float], b: Sequence[float], alpha: float = 0.05) -> SeedTest:
    """Welch's test of mean(b) - mean(a) over per-seed values (e.g. each seed's test accuracy); the
    interval is at level 1 - ``alpha`` and the seeds needed are for a test at ``alpha`` (give the
    adjusted threshold in a family: 0.05 / m gives Bonferroni's simultaneous interval, which covers
    what Holm rejects)."""
    from scipy.stats import ttest_ind

    a, b = np.asarray([x for x in a if math.isfinite(x)]), np.asarray([x for x in b if math.isfinite(x)])
    diff = float(b.mean() - a.mean()) if len(a) and len(b) else math.nan
    if len(a) < 2 or len(b) < 2 or a.var(ddof=1) + b.var(ddof=1) == 0:
        return SeedTest(diff, None, None, None, None)
    res = ttest_ind(b, a, equal_var=False)
    pooled = math.sqrt((a.var(ddof=1) + b.var(ddof=1)) / 2)
    ci = res.confidence_interval(1 - alpha)
    return SeedTest(
        diff,
        float(res.statistic),
        float(res.df),
        float(res.pvalue),
        seeds_needed(diff, pooled, alpha),
        float(ci.low),
        float(ci.high),
    )


#: Above this many ways to split the pooled seeds, :func:`permutation_test` samples them.
EXACT_SPLITS = 200_000


def permutation_test(a: Sequence[float], b: Sequence[float], resamples: int = 100_000, seed: int = 0) -> float | None:
    """Two-sided p of mean(b) - mean(a) under exchangeable seeds: the share of the ways to split the
    pooled per-seed values into arms of these sizes whose difference is at least as far from 0 (every
    split when there are at most :data:`EXACT_SPLITS`, 184,756 for 10 + 10 seeds; else a seeded sample)."""
    from itertools import combinations

    a, b = [x for x in a if math.isfinite(x)], [x for x in b if math.isfinite(x)]
    if len(a) < 2 or len(b) < 2:
        return None
    pooled = np.asarray(a + b, dtype=float)
    n, k, total = len(pooled), len(b), pooled.sum()
    observed = abs(float(np.mean(b) - np.mean(a)))
    if math.comb(n, k) <= EXACT_SPLITS:
        sums = np.fromiter((pooled[list(c)].sum() for c in combinations(range(n), k)), float, math.comb(n, k))
    else:
        rng = np.random.default_rng(seed)
        sums = np.stack([pooled[rng.permutation(n)[:k]].sum() for _ in range(resamples)])
    diffs = np.abs(sums / k - (total - sums) / (n - k))
    return float(np.mean(diffs >= observed - 1e-12))


@dataclass
class FisherTest:
    """Per-seed yes/no outcomes of two arms: the counts, the rates with their exact (Clopper-Pearson)
    intervals, and Fisher's exact two-sided p of rate(b) vs rate(a)."""

    yes_a: int
    n_a: int
    yes_b: int
    n_b: int
    p: float | None
    interval_a: tuple[float, float]
    interval_b: tuple[float, float]

    @property
    def diff(self) -> float:
        return self.yes_b / self.n_b - self.yes_a / self.n_a if self.n_a and self.n_b else math.nan


def rate_interval(yes: int, n: int, alpha: float = 0.05) -> tuple[float, float]:
    """Clopper-Pearson interval of a rate (exact: it covers at least 1 - alpha for every true rate)."""
    from scipy.stats import binomtest

    if n == 0:
        return math.nan, math.nan
    ci = binomtest(yes, n).proportion_ci(1 - alpha, method="exact")
    return float(ci.low), float(ci.high)


def fisher_test(a: Sequence[float], b: Sequence[float], alpha: float = 0.05) -> FisherTest:
    """Fisher's exact test on per-seed outcomes (1: yes, 0: no; NaN left out); intervals at 1 - ``alpha``."""
    from scipy.stats import fisher_exact

    a, b = [bool(x) for x in a if math.isfinite(x)], [bool(x) for x in b if math.isfinite(x)]
    ya, yb = sum(a), sum(b)
    p = float(fisher_exact([[yb, len(b) - yb], [ya, len(a) - ya]]).pvalue) if a and b else None
    return FisherTest(ya, len(a), yb, len(b), p, rate_interval(ya, len(a), alpha), rate_interval(yb, len(b), alpha))


def fisher_power(rate_a: float, rate_b: float, seeds: int, alpha: float = 0.05) -> float:
    """The chance that Fisher's two-sided test at ``alpha`` rejects when each arm's ``seeds`` runs hold
    with the true rates given (exact: every pair of counts, weighted by its binomial chance)."""
    from scipy.stats import binom, fisher_exact

    pa, pb = binom.pmf(range(seeds + 1), seeds, rate_a), binom.pmf(range(seeds + 1), seeds, rate_b)
    return float(
        sum(
            pa[i] * pb[j]
            for i in range(seeds + 1)
            for j in range(seeds + 1)
            if fisher_exact([[j, seeds - j], [i, seeds - i]]).pvalue < alpha
        )
    )


def holm(pvalues: Sequence[float | None]) -> list[float | None]:
    """Holm's step-down adjusted p-values (None stays None): rejecting where the adjusted p is
    below alpha keeps the chance of any false rejection in the family at most alpha."""
    known = sorted((p, i) for i, p in enumerate(pvalues) if p is not None)
    out: list[float | None] = [None] * len(pvalues)
    running = 0.0
    for rank, (p, i) in enumerate(known):
        running = max(running, min(1.0, (len(known) - rank) * p))
        out[i] = running
    return out


def finite_mean(xs: Iterable[float | None]) -> float:
    """The mean of the finite values of ``xs`` (NaN when there is none)."""
    ys = [x for x in xs if x is not None and math.isfinite(x)]
    return sum(ys) / len(ys) if ys else math.nan


def contrast_rows(
    contrasts: Sequence[Mapping[str, str]], seeds_of: Callable[[str], Mapping[str, list]], alpha: float = 0.05
) -> list[dict]:
    """Pre-registered contrasts (b minus a over the per-seed values; ``seeds_of(eval)`` gives each arm's
    runs by variant, as train/organism/step_diagnosis.py's ``per_seed``), Holm-corrected within each
    ``family``. A Welch contrast has its t-interval at 95% and at 1 - alpha/m (Bonferroni over the
    family's m contrasts: simultaneous, so it covers what Holm rejects), the exact permutation p beside
    Welch's, and the seeds per arm a difference of its size needs at alpha/m (Holm's first threshold). A
    Fisher contrast reads a yes/no number per seed (a run holds the chain or not): the counts, each
    rate's exact interval at 1 - alpha/m, and Fisher's exact p."""
    cache: dict[str, Mapping[str, list]] = {}
    sizes = {f: sum(c.get("family", "primary") == f for c in contrasts) for f in _families(contrasts)}
    rows = []
    for c in contrasts:
        family = c.get("family", "primary")
        level = alpha / sizes[family]
        seeds = cache.setdefault(c["eval"], seeds_of(c["eval"]))
        a, b = (
            [run[c["variant"]][c["metric"]] for run in seeds.get(arm, []) if c["variant"] in run]
            for arm in (c["a"], c["b"])
        )
        row = {**c, "family": family, "test": c.get("test", "welch"), "seeds": (len(a), len(b))}
        row.update({"mean_a": finite_mean(a), "mean_b": finite_mean(b), "m": sizes[family], "alpha_adjusted": level})
        if row["test"] == "fisher":
            test = fisher_test(a, b, level)
            row.update(
                diff=test.diff, p=test.p, yes=(test.yes_a, test.yes_b), rate_a=test.interval_a, rate_b=test.interval_b
            )
            row["seeds_needed"] = _rate_seeds_needed(row["mean_a"], row["mean_b"], level)
        else:
            test, wide = seed_test(a, b), seed_test(a, b, level)
            row.update(diff=test.diff, low=test.low, high=test.high, p=test.p, p_perm=permutation_test(a, b))
            row.update(low_adjusted=wide.low, high_adjusted=wide.high, seeds_needed=wide.seeds_needed)
        rows.append(row)
    for family in sizes:
        members = [r for r in rows if r["family"] == family]
        for row, adjusted in zip(members, holm([r["p"] for r in members])):
            row["p_holm"] = adjusted
    return rows


def _families(contrasts: Sequence[Mapping]) -> list[str]:
    return list(dict.fromkeys(c.get("family", "primary") for c in contrasts))


def _rate_seeds_needed(rate_a: float, rate_b: float, alpha: float, power: float = 0.8) -> int | None:
    """Seeds per arm to tell two rates apart (the arcsine approximation; with 0 or 1 it is rough)."""
    from scipy.stats import norm

    if not (math.isfinite(rate_a) and math.isfinite(rate_b)) or rate_a == rate_b:
        return None
    h = abs(2 * math.asin(math.sqrt(rate_b)) - 2 * math.asin(math.sqrt(rate_a)))
    return max(2, math.ceil(((norm.ppf(1 - alpha / 2) + norm.ppf(power)) / h) ** 2))

"""Seed-aware statistics (crystal_grpo/stats.py): the two-level bootstrap covers a true difference
of zero at about its nominal rate when seeds scatter, where a bootstrap over rows alone does
not; the per-seed Welch test and the seeds a difference would need."""

from __future__ import annotations

import math

import numpy as np
import pytest

from crystal_grpo.stats import (
    bootstrap_ci,
    detectable_difference,
    fisher_power,
    fisher_test,
    permutation_test,
    rate_interval,
    seed_test,
    seeds_needed,
    two_level_ci,
)


def test_identical_arms_cover_zero_at_about_the_nominal_rate_and_rows_alone_do_not():
    rng = np.random.default_rng(1)
    seeds, rows, sims = 3, 60, 120
    two_level = rows_only = 0
    for k in range(sims):
        difficulty = rng.normal(0.5, 0.2, rows)  # each row's difficulty, shared by both arms (paired)

        def arm():  # one arm: 3 training seeds, each shifting every row a little (seed-to-seed variance)
            return (difficulty[None] + rng.normal(0, 0.05, (seeds, 1)) + rng.normal(0, 0.1, (seeds, rows)))[..., None]

        a, b = arm(), arm()
        lo, hi = two_level_ci(a, b, 300, k)
        two_level += lo[0] <= 0 <= hi[0]
        lo, hi = bootstrap_ci(b.mean(0) - a.mean(0), 300, k)  # seeds averaged first: what the report did
        rows_only += lo[0] <= 0 <= hi[0]
    assert two_level / sims >= 0.8  # 95% nominal; about 0.88 with 3 seeds (a percentile bootstrap of 3 is short)
    assert rows_only / sims <= 0.6  # about 0.33: "significant" differences between identical arms


def test_a_real_difference_is_found_and_the_interval_has_the_right_sign():
    rng = np.random.default_rng(0)
    a = rng.normal(0.3, 0.02, (3, 80, 1))
    b = rng.normal(0.5, 0.02, (3, 80, 1))
    lo, hi = two_level_ci(a, b, 500, 0)
    assert 0.15 < lo[0] < 0.2 < hi[0] < 0.25


def test_arms_must_share_their_rows():
    with pytest.raises(ValueError, match="same rows"):
        two_level_ci(np.zeros((3, 10, 1)), np.zeros((3, 11, 1)), 10, 0)


def test_seed_test_matches_welch_and_says_how_many_seeds_a_difference_needs():
    test = seed_test([0.639, 0.612, 0.661], [0.688, 0.640, 0.737])
    assert test.diff == pytest.approx(0.051, abs=1e-9)
    # Welch by hand: se^2 = va/3 + vb/3
    va, vb = np.var([0.639, 0.612, 0.661], ddof=1), np.var([0.688, 0.640, 0.737], ddof=1)
    assert test.t == pytest.approx(0.051 / math.sqrt(va / 3 + vb / 3))
    assert 0.05 < test.p < 0.5  # not significant with 3 seeds each
    assert test.seeds_needed == math.ceil(2 * ((1.959964 + 0.841621) * math.sqrt((va + vb) / 2) / 0.051) ** 2)
    assert seeds_needed(0.0, 0.1) is None and seed_test([0.5], [0.6]).p is None


def test_the_welch_t_interval_on_seed_means_covers_at_about_its_nominal_rate_with_three_seeds():
    """The same identical arms as above, many more draws (no resampling: cheap): the t-interval on the
    per-seed means covers 0 in about 95% of them, where the two-level percentile bootstrap gives ~88%."""
    rng = np.random.default_rng(2)
    seeds, rows, sims = 3, 60, 2000
    covered = 0
    for _ in range(sims):
        difficulty = rng.normal(0.5, 0.2, rows)
        a, b = (
            (difficulty[None] + rng.normal(0, 0.05, (seeds, 1)) + rng.normal(0, 0.1, (seeds, rows))).mean(1)
            for _ in range(2)
        )
        test = seed_test(a, b)
        covered += test.low <= 0 <= test.high
    assert 0.93 <= covered / sims <= 0.97


def test_holm_adjusts_step_down_and_keeps_missing_tests_missing():
    from crystal_grpo.stats import holm

    assert holm([0.01, 0.04, None, 0.03, 0.5]) == pytest.approx([0.04, 0.09, None, 0.09, 0.5])
    assert holm([0.2, 0.2]) == [0.4, 0.4] and holm([]) == [] and holm([0.9, 0.8]) == [1.0, 1.0]


def test_the_detectable_difference_is_found_about_as_often_as_the_power_asked_for():
    """Five seeds an arm, unequal spreads, a strict (Holm-like) alpha: simulated Welch tests at that
    true difference reject in about 80% of draws, and at half of it far less often."""
    from scipy.stats import ttest_ind

    sd_a, sd_b, alpha = 0.04, 0.2, 0.05 / 5
    d = detectable_difference(sd_a, sd_b, 5, alpha)
    rng = np.random.default_rng(3)

    def rate(diff: float) -> float:
        b, a = rng.normal(diff, sd_b, (4000, 5)), rng.normal(0, sd_a, (4000, 5))
        return float(np.mean(ttest_ind(b, a, axis=1, equal_var=False).pvalue < alpha))

    assert 0.74 < rate(d) < 0.88
    assert rate(d / 2) < 0.4
    normal = (1.959964 + 0.841621) * 0.1 * math.sqrt(2 / 10_000)  # many seeds: the normal approximation
    assert detectable_difference(0.1, 0.1, 10_000) == pytest.approx(normal, rel=1e-3)
    with pytest.raises(ValueError, match="seeds >= 2"):
        detectable_difference(0.1, 0.1, 1)


def test_an_adjusted_threshold_widens_the_interval_and_asks_for_more_seeds():
    a, b = [0.61, 0.58, 0.66, 0.60, 0.63], [0.70, 0.64, 0.73, 0.69, 0.66]
    plain, adjusted = seed_test(a, b), seed_test(a, b, alpha=0.05 / 6)
    assert plain.p == adjusted.p and plain.diff == adjusted.diff
    assert adjusted.low < plain.low < plain.diff < plain.high < adjusted.high
    assert adjusted.seeds_needed > plain.seeds_needed
    assert seeds_needed(0.1, 0.1) == math.ceil(2 * ((1.959964 + 0.841621) * 1.0) ** 2)


def test_the_permutation_test_counts_every_split_of_the_pooled_seeds():
    # 2 + 2 seeds: 6 splits; |diff| of the observed split (0, 1 | 10, 11) is 10, reached by it and its mirror
    assert permutation_test([0, 1], [10, 11]) == pytest.approx(2 / 6)
    assert permutation_test([0, 1, 2], [0, 1, 2]) == 1.0
    # 10 + 10 well separated seeds: only the observed split and its mirror are as extreme
    assert permutation_test(list(range(10)), list(range(100, 110))) == pytest.approx(2 / math.comb(20, 10))
    assert permutation_test([0.5], [0.6, 0.7]) is None
    rng = np.random.default_rng(3)  # above EXACT_SPLITS it samples; still near the exact answer's order
    a, b = rng.normal(0, 1, 12).tolist(), rng.normal(1.5, 1, 12).tolist()
    assert permutation_test(a, b, resamples=20_000) < 0.01


def test_fisher_reads_per_seed_outcomes_with_exact_rate_intervals():
    test = fisher_test([0, 0, 1, 0, 0, 0, 0, 0, 1, 0], [1, 1, 1, 1, 1, 1, 1, 1, 1, 0])
    assert (test.yes_a, test.n_a, test.yes_b, test.n_b) == (2, 10, 9, 10)
    assert test.diff == pytest.approx(0.7) and test.p == pytest.approx(0.00547, abs=1e-4)
    assert test.interval_a[0] < 0.2 < test.interval_a[1] and test.interval_b[1] <= 1.0
    low, high = rate_interval(0, 10)
    assert low == 0.0 and high == pytest.approx(1 - 0.025 ** (1 / 10))  # Clopper-Pearson at 0 of n
    assert fisher_test([1, 1, math.nan], [0, 0]).n_a == 2


def test_fishers_power_is_its_rejection_rate():
    assert fisher_power(0.5, 0.5, 10) <= 0.05  # exact: never above alpha when nothing differs
    assert fisher_power(0.0, 1.0, 10, alpha=0.05 / 6) == pytest.approx(1.0)
    rng = np.random.default_rng(0)
    sims = [fisher_test(rng.random(10) < 0.2, rng.random(10) < 0.9).p < 0.05 for _ in range(400)]
    assert abs(np.mean(sims) - fisher_power(0.2, 0.9, 10)) < 0.06

"""rewards/references.py: threshold graph, connected components, medoid (Eq. 1), consensus and
ordering on hand-made embeddings whose answer is known, and collapse detection."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from crystal_grpo.rewards.encoder import PACKAGED_MINILM, PAPER_ENCODER
from crystal_grpo.rewards.references import (
    PAPER_CLUSTER_THRESHOLD,
    Trajectory,
    aggregate,
    collapse_reasons,
    components,
    default_threshold,
    medoid,
)


def unit(*xs: float) -> torch.Tensor:
    return F.normalize(torch.tensor(xs, dtype=torch.float32), dim=0)


def three_solutions():
    """Steps A, B, C in order in t0; t1 adds a step D nobody else has; t2 skips B. Directions:
    A ~ x, B ~ y, C ~ z, D between all three (cosine 0.58 to each)."""
    trs = [
        Trajectory(["A0", "B0", "C0"], "g1"),
        Trajectory(["A1", "B1", "D1", "C1"], "g2"),
        Trajectory(["A2", "C2"], "g1"),
    ]
    emb = [
        torch.stack([unit(1, 0.1, 0), unit(0, 1, 0), unit(0, 0, 1)]),
        torch.stack([unit(1, 0, 0), unit(0, 1, 0.1), unit(1, 1, 1), unit(0, 0, 1)]),
        torch.stack([unit(1, -0.1, 0), unit(0.05, 0, 1)]),
    ]
    return trs, emb


def test_components_follow_chains_of_links():
    sim = torch.eye(6)
    for a, b in ((0, 1), (1, 2), (4, 5)):
        sim[a, b] = sim[b, a] = 0.9
    sim[0, 2] = sim[2, 0] = 0.1  # 0 and 2 join through 1 anyway: single linkage
    assert components(sim, 0.5) == [[0, 1, 2], [3], [4, 5]]
    assert components(sim, 0.95) == [[0], [1], [2], [3], [4], [5]]
    assert components(sim, 0.9) == [[0, 1, 2], [3], [4, 5]]  # inclusive, like Match F1's tau
    assert components(torch.zeros(0, 0), 0.5) == []


def test_medoid_is_eq1_and_ties_go_to_the_earliest_member():
    e = torch.stack([unit(1, 0.3, 0), unit(1, 0, 0), unit(1, -0.3, 0), unit(0, 1, 0)])
    sim = e @ e.T
    assert medoid(sim, [0, 1, 2]) == 1  # the centre has the largest summed similarity
    assert medoid(sim, [0, 2]) == 0  # symmetric pair: a tie
    assert medoid(sim, [2, 0]) == 2  # "earliest" is the order the members are given in
    assert medoid(sim, [3]) == 3


def test_consensus_chain_on_known_embeddings():
    trs, emb = three_solutions()
    chain = aggregate(trs, emb, threshold=0.9, min_support=2)
    # A: medoid A1 (closest to both others); B: B0 and B1 tie, B0 is first; C: C0 and C1 are
    # the same vector, C0 is first. D is in one trajectory only: dropped.
    assert chain.steps == ["A1", "B0", "C0"]
    assert [c.support for c in chain.clusters] == [3, 2, 3]
    assert [len(c.members) for c in chain.clusters] == [3, 2, 3]
    assert [c.generators for c in chain.clusters] == [["g1", "g2"], ["g1", "g2"], ["g1", "g2"]]
    assert [c.text for c in chain.dropped] == ["D1"]
    # Mean normalised positions, (i + 0.5) / n averaged over the trajectories with the step.
    expect = [(0.5 / 3 + 0.5 / 4 + 0.5 / 2) / 3, (1.5 / 3 + 1.5 / 4) / 2, (2.5 / 3 + 3.5 / 4 + 1.5 / 2) / 3]
    assert [c.position for c in chain.clusters] == pytest.approx(expect, abs=1e-6)
    assert chain.n_steps == 9 and chain.median_length == 3 and chain.collapse == []


def test_a_step_in_one_trajectory_is_kept_without_consensus_and_placed_by_position():
    trs, emb = three_solutions()
    chain = aggregate(trs, emb, threshold=0.9, min_support=1)
    assert chain.steps == ["A1", "B0", "D1", "C0"]  # D at 2.5/4 = 0.625, between B and C
    assert chain.clusters[2].support == 1 and chain.clusters[2].generators == ["g2"]
    assert aggregate(trs, emb, threshold=0.9, min_support=4).steps == []  # nothing reaches 4 trajectories


def test_equal_positions_keep_first_appearance():
    x, y = unit(1, 0), unit(0, 1)
    trs = [Trajectory(["X", "Y"], "a"), Trajectory(["Y'", "X'"], "b")]
    chain = aggregate(trs, [torch.stack([x, y]), torch.stack([y, x])], threshold=0.9)
    assert [c.position for c in chain.clusters] == [0.5, 0.5]
    assert chain.steps == ["X", "Y"]
    swapped = aggregate(trs[::-1], [torch.stack([y, x]), torch.stack([x, y])], threshold=0.9)
    assert swapped.steps == ["Y'", "X'"]


def test_empty_trajectories_count_for_nothing():
    trs, emb = three_solutions()
    with_empty = [Trajectory([], "g3"), *trs[:2], Trajectory([], "g1"), trs[2]]
    empty = torch.zeros(0, 3)
    chain = aggregate(with_empty, [empty, *emb[:2], empty, emb[2]], threshold=0.9)
    assert chain.steps == ["A1", "B0", "C0"]
    assert [c.support for c in chain.clusters] == [3, 2, 3] and chain.median_length == 3
    nothing = aggregate([Trajectory([], "g")], [empty], threshold=0.9)
    assert nothing.steps == [] and nothing.clusters == [] and nothing.collapse == []
    assert aggregate([], [], threshold=0.9).steps == []


def test_a_threshold_below_the_step_similarity_collapses_and_is_reported():
    trs, emb = three_solutions()
    chain = aggregate(trs, emb, threshold=0.0, min_support=2)  # every pair linked: one cluster
    assert len(chain.clusters) == 1 and chain.largest_cluster == 9
    assert chain.collapse == [
        "one cluster holds 9 of the 9 steps",
        "1 cluster(s) from trajectories of a median 3 steps",
    ]
    assert chain.warnings == []


def test_a_chain_short_for_lack_of_consensus_is_a_warning_not_collapse():
    x, y, z, w = unit(1, 0, 0, 0), unit(0, 1, 0, 0), unit(0, 0, 1, 0), unit(0, 0, 0, 1)
    trs = [Trajectory(["X", "Y", "Z"], "a"), Trajectory(["X'", "W", "W2"], "b")]
    chain = aggregate(trs, [torch.stack([x, y, z]), torch.stack([x, w, -w])], threshold=0.9)
    assert chain.steps == ["X"] and chain.collapse == []
    assert chain.warnings == [
        "the chain has 1 step(s), the trajectories a median of 3: most steps were in fewer than 2 trajectories"
    ]


def test_collapse_rules():
    assert collapse_reasons(n_steps=10, largest=6, n_clusters=3, median_length=5) == [
        "one cluster holds 6 of the 10 steps"
    ]
    assert collapse_reasons(10, 5, 2, 5) == ["2 cluster(s) from trajectories of a median 5 steps"]
    assert collapse_reasons(10, 5, 3, 5) == []
    # One- and two-step solutions: one cluster holding most steps is what agreement looks like.
    assert collapse_reasons(6, 6, 1, 2) == []
    assert collapse_reasons(0, 0, 0, 0) == []


def test_default_thresholds():
    assert default_threshold(PAPER_ENCODER) == PAPER_CLUSTER_THRESHOLD == 0.45
    assert PAPER_CLUSTER_THRESHOLD < default_threshold(PACKAGED_MINILM) < 1
    assert default_threshold("some/other-encoder") is None

"""One reference chain from several solutions of a problem (CRYSTAL Sec. 3.1, docs/method.md section 11).

Every step of every trajectory is embedded; pairs with cosine >= tau_c are linked, each
connected component of that graph is a cluster, and each cluster is represented by its
medoid (Eq. 1: the member with the highest summed similarity to the rest). Clusters that
fewer than ``min_support`` distinct trajectories reach are dropped (the consensus), and
the medoids are ordered by their mean normalised position in the trajectories that
contain them. The paper does not say how it orders them; this is the decision here.

Connected components chain: one pair above tau_c is enough to merge two clusters, so tau_c
must sit above the similarity of *different* steps of one problem, which depends on the
encoder. ``collapse_reasons`` catches a threshold that merged a row's steps anyway.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from crystal_grpo.rewards.encoder import PACKAGED_MINILM, PAPER_ENCODER
from crystal_grpo.rewards.match_f1 import MatchF1Scorer

#: The paper's tau_c, chosen for its encoder; with MiniLM it merges every step of a problem.
PAPER_CLUSTER_THRESHOLD = 0.45
#: tau_c per shipped encoder. MiniLM's is measured on the shipped data (``build_references.py
#: --measure_threshold``, docs/references.md): on the 2,859 pairs of
#: different reference steps of one row in data/wordproblems/train.jsonl the median cosine is
#: 0.435, the 99th percentile 0.878 (templated steps such as "After using 4, he has 30 - 4 = 26."
#: and "After using 2, he has 5 - 2 = 3." are that close); 0.88 keeps 99% of them apart.
CLUSTER_THRESHOLDS: dict[str, float] = {PACKAGED_MINILM: 0.88, PAPER_ENCODER: PAPER_CLUSTER_THRESHOLD}

#: Collapse: with trajectories of at least COLLAPSE_MIN_STEPS steps (median), one cluster
#: holding more than COLLAPSE_SHARE of all steps, or fewer clusters than COLLAPSE_LENGTH_RATIO
#: of the median trajectory's steps, means tau_c merged different steps. A chain that short
#: because its clusters were dropped (below min_support) is disagreement, and only a warning.
COLLAPSE_MIN_STEPS = 3
COLLAPSE_SHARE = 0.5
COLLAPSE_LENGTH_RATIO = 0.5
#: Similarities within this of the best count as a tie (one text embedded twice may differ in
#: the last bits); ties go to the earliest step.
TIE_TOLERANCE = 1e-6


def default_threshold(encoder: object) -> float | None:
    """tau_c for a shipped encoder, None for any other (it has to be measured)."""
    return CLUSTER_THRESHOLDS.get(encoder) if isinstance(encoder, str) else None


@dataclass
class Trajectory:
    """One solution's steps, and which generator (model or trajectory file) wrote it."""

    steps: list[str]
    generator: str


@dataclass
class Cluster:
    """Steps linked by the threshold graph; ``members`` are ``(trajectory, position)`` pairs."""

    members: list[tuple[int, int]]
    medoid: tuple[int, int]
    text: str
    support: int  # distinct trajectories with a member
    generators: list[str]  # distinct generators with a member, in first-seen order
    position: float  # mean normalised position over the trajectories that contain it


@dataclass
class BuiltChain:
    """The consensus chain of one row and what it was made of."""

    steps: list[str]
    clusters: list[Cluster]  # the kept clusters, in chain order
    dropped: list[Cluster] = field(default_factory=list)  # below min_support
    n_steps: int = 0  # steps in all trajectories
    median_length: float = 0.0  # of the non-empty trajectories
    collapse: list[str] = field(default_factory=list)  # why it looks collapsed; empty when fine
    warnings: list[str] = field(default_factory=list)  # not collapse, but worth a look

    @property
    def largest_cluster(self) -> int:
        return max((len(c.members) for c in self.clusters + self.dropped), default=0)


def components(sim: torch.Tensor, threshold: float) -> list[list[int]]:
    """Connected components of the graph linking pairs with ``sim >= threshold``.

    Each component is sorted; components are ordered by their first node. Label
    propagation (every node takes the smallest label among its neighbours) settles in at
    most as many rounds as the longest path, a handful for a row's few dozen steps.
    """
    n = sim.shape[0]
    if n == 0:
        return []
    adj = (sim >= threshold) | torch.eye(n, dtype=torch.bool, device=sim.device)
    labels = torch.arange(n, device=sim.device)
    while True:
        new = torch.where(adj, labels.unsqueeze(0), n).min(dim=1).values
        if torch.equal(new, labels):
            break
        labels = new
    groups: dict[int, list[int]] = {}
    for node, label in enumerate(labels.tolist()):
        groups.setdefault(label, []).append(node)
    return list(groups.values())


def medoid(sim: torch.Tensor, members: Sequence[int]) -> int:
    """Eq. 1: the member with the smallest summed distance (1 - cos) to the cluster, i.e. the
    largest summed similarity; ties go to the earliest member."""
    idx = torch.as_tensor(list(members), dtype=torch.long, device=sim.device)
    total = sim[idx][:, idx].double().sum(dim=1)
    return int(members[int((total >= total.max() - TIE_TOLERANCE).nonzero()[0])])


def collapse_reasons(n_steps: int, largest: int, n_clusters: int, median_length: float) -> list[str]:
    """Why a row's clusters look like tau_c merged different steps (empty when they do not)."""
    if median_length < COLLAPSE_MIN_STEPS or n_steps == 0:
        return []
    out = []
    if largest > COLLAPSE_SHARE * n_steps:
        out.append(f"one cluster holds {largest} of the {n_steps} steps")
    if n_clusters < COLLAPSE_LENGTH_RATIO * median_length:
        out.append(f"{n_clusters} cluster(s) from trajectories of a median {median_length:g} steps")
    return out


def aggregate(
    trajectories: Sequence[Trajectory], embeddings: Sequence[torch.Tensor], threshold: float, min_support: int = 2
) -> BuiltChain:
    """The consensus chain of docs/method.md section 11 from trajectories and their step embeddings
    (``embeddings[t]`` is ``[len(steps_t), d]``, L2-normalised). Empty trajectories count for
    nothing. A step's normalised position in a trajectory of n steps is (i + 0.5) / n, the
    centre of its slot, so a one-step trajectory places its step in the middle; several
    members in one trajectory count as their mean. Ties in position keep first appearance."""
    nodes = [(t, i) for t, tr in enumerate(trajectories) for i in range(len(tr.steps))]
    lengths = [len(tr.steps) for tr in trajectories if tr.steps]
    median = float(statistics.median(lengths)) if lengths else 0.0
    if not nodes:
        return BuiltChain([], [], [], 0, median, [])
    emb = torch.cat([e.reshape(len(tr.steps), -1) for e, tr in zip(embeddings, trajectories) if tr.steps])
    sim = emb.float() @ emb.float().T
    clusters = [_cluster(trajectories, nodes, sim, group) for group in components(sim, threshold)]
    kept = [c for c in clusters if c.support >= min_support]
    dropped = [c for c in clusters if c.support < min_support]
    kept.sort(key=lambda c: c.position)  # stable: equal positions keep first appearance
    chain = BuiltChain([c.text for c in kept], kept, dropped, len(nodes), median)
    chain.collapse = collapse_reasons(len(nodes), chain.largest_cluster, len(clusters), median)
    if not chain.collapse and median >= COLLAPSE_MIN_STEPS and len(kept) < COLLAPSE_LENGTH_RATIO * median:
        chain.warnings.append(
            f"the chain has {len(kept)} step(s), the trajectories a median of {median:g}: "
            f"most steps were in fewer than {min_support} trajectories"
        )
    return chain


def _cluster(
    trajectories: Sequence[Trajectory], nodes: list[tuple[int, int]], sim: torch.Tensor, group: list[int]
) -> Cluster:
    members = [nodes[g] for g in group]
    t, i = nodes[medoid(sim, group)]
    per_trajectory: dict[int, list[float]] = {}
    for mt, mi in members:
        per_trajectory.setdefault(mt, []).append((mi + 0.5) / len(trajectories[mt].steps))
    generators = list(dict.fromkeys(trajectories[mt].generator for mt in per_trajectory))
    position = statistics.fmean(statistics.fmean(p) for p in per_trajectory.values())
    return Cluster(members, (t, i), trajectories[t].steps[i], len(per_trajectory), generators, position)


def embed_steps(scorer: MatchF1Scorer, lists: Sequence[Sequence[str]]) -> list[torch.Tensor]:
    """``[len(steps), d]`` embeddings for each list (on CPU), every distinct text embedded once
    through the scorer's encoder and cache."""
    texts = list(dict.fromkeys(s for steps in lists for s in steps))
    table = scorer.embed(texts).float().cpu() if texts else torch.zeros(0, 1)
    row = {s: k for k, s in enumerate(texts)}
    return [table[torch.tensor([row[s] for s in steps], dtype=torch.long)] for steps in lists]


def distinct_step_similarities(scorer: MatchF1Scorer, chains: Sequence[Sequence[str]]) -> torch.Tensor:
    """Cosine of every pair of different steps within each chain (reference chains of a data
    set): what tau_c has to stay above, or the threshold graph links a problem's steps."""
    parts = []
    for e in embed_steps(scorer, [list(dict.fromkeys(c)) for c in chains]):
        upper = torch.triu_indices(len(e), len(e), 1)
        parts.append((e @ e.T)[upper[0], upper[1]])
    return torch.cat(parts) if parts else torch.zeros(0)


def suggest_threshold(similarities: torch.Tensor, quantile: float = 0.99) -> float:
    """tau_c above ``quantile`` of the different-step similarities, rounded up to 0.01: single
    linkage turns each link between different steps into a merge, so few may stay above it."""
    return math.ceil(float(torch.quantile(similarities.double(), quantile)) * 100) / 100


def build_chain(
    scorer: MatchF1Scorer, trajectories: Sequence[Trajectory], threshold: float, min_support: int = 2
) -> BuiltChain:
    """:func:`aggregate` with the scorer's encoder and embedding cache."""
    return aggregate(trajectories, embed_steps(scorer, [t.steps for t in trajectories]), threshold, min_support)

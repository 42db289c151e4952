"""Match F1 and Ordered Match F1 for a whole GRPO generation batch (docs/method.md sections 3, 4, 11).

One ``MatchF1Scorer`` per process embeds steps with a sentence encoder and matches predicted
steps 1:1 against reference steps. Built for GRPO batches, where each prompt's reference chain
repeats once per generation and every epoch: each unique text is encoded at most once a call,
reference steps can be embedded once and kept (:meth:`MatchF1Scorer.pin`), an LRU cache keeps
the rest, and the matching runs vectorised (``rewards.matching``). ``step_gate="facts"`` never
matches steps whose stated facts disagree (``rewards.facts``). ``encoder="exact"`` loads no model:
two steps are similar (1) when their normalised strings are equal, and everything after that is
the same code.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Literal, Union

import torch

from crystal_grpo.rewards.encoder import PACKAGED_MINILM, is_exact, load_encoder, normalize_step
from crystal_grpo.rewards.facts import StepGate, gate_blocks
from crystal_grpo.rewards.matching import dp_match, greedy_match, longest_chain
from crystal_grpo.rewards.text import clean_text

Chain = Sequence[str]
# One example's references: a single chain, or several alternative chains (best wins).
References = Union[Chain, Sequence[Chain]]


@dataclass
class StepScores:
    """Per-example step metrics; every tensor has one entry per example (on CPU)."""

    precision: torch.Tensor
    recall: torch.Tensor
    f1: torch.Tensor
    lis_ratio: torch.Tensor
    ordered_f1: torch.Tensor
    n_pred: torch.Tensor
    n_ref: torch.Tensor
    n_matched: torch.Tensor
    #: Accepted ``(pred_idx, ref_idx)`` pairs per example, an int64 ``[r, 2]`` tensor each.
    pairs: list[torch.Tensor] = field(repr=False)
    #: Which reference chain won for each example (0 when there is only one).
    best_reference: torch.Tensor = field(repr=False, default=None)
    #: The similarity of each accepted pair, in the order of ``pairs`` (float ``[r]`` each).
    pair_similarity: list[torch.Tensor] = field(repr=False, default_factory=list)

    def __len__(self) -> int:
        return len(self.f1)

    def mean(self) -> dict[str, float]:
        """Macro averages (dataset Match F1 is the mean of per-example F1)."""
        if len(self) == 0:
            return {}
        return {
            "precision": self.precision.mean().item(),
            "recall": self.recall.mean().item(),
            "f1": self.f1.mean().item(),
            "lis_ratio": self.lis_ratio.mean().item(),
            "ordered_f1": self.ordered_f1.mean().item(),
            "n_pred": self.n_pred.float().mean().item(),
            "n_ref": self.n_ref.float().mean().item(),
        }


def _padded_index(lists: Sequence[Sequence[int]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Ragged int lists -> ``[B, L]`` index tensor padded with -1, and lengths ``[B]``."""
    lengths = torch.tensor([len(x) for x in lists], dtype=torch.long)
    flat = torch.tensor([i for x in lists for i in x], dtype=torch.long)
    B, L = len(lists), int(lengths.max()) if len(lists) else 0
    out = torch.full((B, L), -1, dtype=torch.long)
    if flat.numel():
        row = torch.repeat_interleave(torch.arange(B), lengths)
        start = torch.cumsum(lengths, 0) - lengths
        pos = torch.arange(flat.numel()) - torch.repeat_interleave(start, lengths)
        out[row, pos] = flat
    return out.to(device), lengths.to(device)


def metrics_from_matches(
    matched: torch.Tensor, n_pred: torch.Tensor, n_ref: torch.Tensor, alpha: float, sim: torch.Tensor | None = None
) -> StepScores:
    """Precision/recall/F1 (with every empty-side rule), LIS ratio and Ordered F1; with ``sim``
    (the ``[B, N, M]`` similarities matched on) each accepted pair's similarity too."""
    tp = matched.sum(dim=(1, 2))
    tpf, npf, nrf = tp.double(), n_pred.double(), n_ref.double()
    precision = tpf / npf.clamp(min=1)
    recall = tpf / nrf.clamp(min=1)
    denom = precision + recall
    f1 = torch.where(denom > 0, 2 * precision * recall / denom.clamp(min=1e-300), torch.zeros_like(denom))
    f1 = torch.where((n_pred == 0) & (n_ref == 0), torch.ones_like(f1), f1)
    lis = longest_chain(matched).double()
    lis_ratio = torch.where(tp >= 2, lis / tpf.clamp(min=1), torch.ones_like(lis))
    ordered = f1 * ((1 - alpha) + alpha * lis_ratio)
    nz = matched.nonzero()
    counts = tp.cpu().tolist()
    pairs = list(torch.split(nz[:, 1:].cpu(), counts)) if len(tp) else []
    pair_sim = [] if sim is None or not len(tp) else list(torch.split(sim[matched].float().cpu(), counts))
    cpu = lambda t: t.float().cpu()
    return StepScores(
        precision=cpu(precision),
        recall=cpu(recall),
        f1=cpu(f1),
        lis_ratio=cpu(lis_ratio),
        ordered_f1=cpu(ordered),
        n_pred=n_pred.cpu(),
        n_ref=n_ref.cpu(),
        n_matched=tp.cpu(),
        pairs=pairs,
        best_reference=torch.zeros(len(tp), dtype=torch.long),
        pair_similarity=pair_sim,
    )


def match_similarities(
    sim: torch.Tensor,
    n_pred: torch.Tensor,
    n_ref: torch.Tensor,
    threshold: float,
    alpha: float,
    matcher: Literal["greedy", "dp"] = "greedy",
) -> StepScores:
    """Score a padded ``[B, N, M]`` similarity batch whose real sizes are ``n_pred, n_ref``."""
    B, N, M = sim.shape
    rows = torch.arange(N, device=sim.device).view(1, N, 1) < n_pred.view(B, 1, 1)
    cols = torch.arange(M, device=sim.device).view(1, 1, M) < n_ref.view(B, 1, 1)
    match = greedy_match if matcher == "greedy" else dp_match
    return metrics_from_matches(match(sim, rows & cols, threshold), n_pred, n_ref, alpha, sim)


def _select(scores: StepScores, rows: torch.Tensor) -> StepScores:
    pick = lambda t: t[rows]
    return StepScores(
        precision=pick(scores.precision),
        recall=pick(scores.recall),
        f1=pick(scores.f1),
        lis_ratio=pick(scores.lis_ratio),
        ordered_f1=pick(scores.ordered_f1),
        n_pred=pick(scores.n_pred),
        n_ref=pick(scores.n_ref),
        n_matched=pick(scores.n_matched),
        pairs=[scores.pairs[i] for i in rows.tolist()],
        best_reference=scores.best_reference,
        pair_similarity=[scores.pair_similarity[i] for i in rows.tolist()] if scores.pair_similarity else [],
    )


def best_per_example(scores: StepScores, row_example: torch.Tensor, n_examples: int) -> StepScores:
    """Several reference chains (StepSTEM Eq. 14): keep the best row per example.

    Best = highest F1, then highest Ordered F1, then the first chain.
    """
    if len(row_example) == n_examples:
        return scores
    # Stable sorts applied from the least to the most significant key.
    order = torch.arange(len(row_example))
    for key in (-scores.ordered_f1, -scores.f1, row_example.float()):
        order = order[torch.sort(key[order], stable=True).indices]
    counts = torch.bincount(row_example, minlength=n_examples)
    first = torch.cumsum(counts, 0) - counts
    rows = order[first]
    out = _select(scores, rows)
    out.best_reference = rows - (torch.cumsum(counts, 0) - counts)
    return out


class MatchF1Scorer:
    """Batched Match F1 / Ordered Match F1 with a sentence encoder.

    Args:
        encoder: hub id (local cache only when ``HF_HUB_OFFLINE=1``), local folder, a
            ready ``SentenceTransformer``, ``"packaged:all-MiniLM-L6-v2"``, or ``"exact"``
            (normalised string identity, no model). The paper used
            ``sentence-transformers/all-distilroberta-v1``.
        threshold: minimum cosine for a match (inclusive), the paper's tau = 0.35; with
            ``"exact"`` any value in (0, 1] means "equal strings match".
        alpha: weight of the order term in Ordered F1. device: ``None`` picks CUDA when available.
        batch_size: encoder batch size. cache_size: text embeddings kept across calls (LRU); 0: none.
        matcher: ``"greedy"`` (the paper) or ``"dp"`` (order-preserving alignment).
        step_gate: ``"none"`` or ``"facts"``: a pair of steps whose facts disagree never
            matches (``rewards.facts``), numbers compared within ``rel_tol`` / ``abs_tol``
            as the answer judge compares them.
    """

    def __init__(
        self,
        encoder=PACKAGED_MINILM,
        threshold: float = 0.35,
        alpha: float = 0.3,
        device: str | torch.device | None = None,
        batch_size: int = 128,
        cache_size: int = 50_000,
        matcher: Literal["greedy", "dp"] = "greedy",
        step_gate: StepGate = "none",
        rel_tol: float = 1e-2,
        abs_tol: float = 1e-6,
    ) -> None:
        if matcher not in ("greedy", "dp"):
            raise ValueError(f"matcher={matcher!r}: allowed values are 'greedy', 'dp'")
        if step_gate not in ("none", "facts"):
            raise ValueError(f"step_gate={step_gate!r}: allowed values are 'none', 'facts'")
        if not 0.0 <= alpha <= 1.0:
            raise ValueError(f"alpha={alpha!r}: must lie in [0, 1]")
        self.exact = is_exact(encoder)
        if self.exact and not 0.0 < threshold <= 1.0:
            raise ValueError(
                f"threshold={threshold!r} with the exact encoder: similarities are 0 or 1, so it must "
                "lie in (0, 1] (at <= 0 every pair of steps would match)"
            )
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.model = None if self.exact else load_encoder(encoder, self.device)
        if self.model is not None:
            self.model.eval()
            if self.device.type == "cuda":
                self.model.half()
        self.threshold, self.alpha, self.matcher = float(threshold), float(alpha), matcher
        self.step_gate, self.rel_tol, self.abs_tol = step_gate, float(rel_tol), float(abs_tol)
        self.batch_size, self.cache_size = batch_size, cache_size
        self._cache: OrderedDict[str, torch.Tensor] = OrderedDict()
        self._pinned: dict[str, torch.Tensor] = {}
        self.last_encoded = 0  # texts actually run through the encoder by the last call

    # -- embeddings -------------------------------------------------------------------
    @torch.inference_mode()
    def embed(self, texts: Sequence[str]) -> torch.Tensor:
        """L2-normalised embeddings ``[len(texts), d]`` on the scorer's device.

        ``texts`` should be unique; cached ones are reused, the rest encoded in one call.
        Any str is accepted: lone surrogates (which the tokenizer rejects) are encoded as
        U+FFFD, so model output can never stop the reward. The exact encoder has no
        embeddings (its similarity is string identity): it raises.
        """
        if self.exact:
            raise ValueError(
                "the exact encoder compares normalised strings and has no embeddings; use a sentence "
                "encoder where embeddings are needed (e.g. clustering reference steps)"
            )
        cache, pinned = self._cache, self._pinned
        missing = [t for t in texts if t not in pinned and t not in cache]
        self.last_encoded = len(missing)
        fresh = dict(zip(missing, self._encode(missing))) if missing else {}
        rows = []
        for t in texts:
            e = fresh.get(t)
            if e is None:
                e = pinned.get(t)
            if e is None:
                e = cache[t]
                cache.move_to_end(t)
            rows.append(e)
        if self.cache_size > 0:
            cache.update(fresh)
            while len(cache) > self.cache_size:
                cache.popitem(last=False)
        if not rows:
            # sentence-transformers 6 renamed get_sentence_embedding_dimension.
            get_dim = (
                getattr(self.model, "get_embedding_dimension", None) or self.model.get_sentence_embedding_dimension
            )
            dim = get_dim() or 1
            return torch.zeros(0, dim, device=self.device)
        return torch.stack(rows)

    @torch.inference_mode()
    def pin(self, texts: Iterable[str], chunk: int = 8192) -> int:
        """Embed ``texts`` now and keep them for the scorer's lifetime (never evicted).

        For reference steps, which are known before training: one batched pass up front
        instead of a few reference texts inside every GRPO step, and never again once the
        completions' steps have pushed them out of the LRU. The work over an epoch is the
        same; it leaves the step. Memory: one embedding per text (384 fp16 values with
        MiniLM on CUDA, 768 B; fp32 on CPU). Returns how many texts were encoded (the
        exact encoder encodes nothing: 0).
        """
        if self.exact:
            return 0
        new = [t for t in dict.fromkeys(texts) if t not in self._pinned]
        for i in range(0, len(new), chunk):
            part = new[i : i + chunk]
            self._pinned.update(zip(part, self._encode(part)))
        return len(new)

    def _encode(self, texts: Sequence[str]) -> torch.Tensor:
        return self.model.encode(
            [clean_text(t) for t in texts],
            batch_size=self.batch_size,
            convert_to_tensor=True,
            normalize_embeddings=True,
            show_progress_bar=False,
            device=str(self.device),
        )

    # -- scoring ----------------------------------------------------------------------
    def score(self, predicted: Sequence[Sequence[str]], references: Sequence[References]) -> StepScores:
        """Score each example's predicted steps against its reference chain(s).

        Each ``references[i]`` is a list of strings, or a list of alternative chains
        (lists of strings), in which case the best-scoring chain wins.
        """
        if len(predicted) != len(references):
            raise ValueError(f"{len(predicted)} predictions but {len(references)} references")
        vocab: dict[str, int] = {}
        idx = lambda steps: [vocab.setdefault(s, len(vocab)) for s in steps]
        pred_idx = [idx(p) for p in predicted]
        ref_idx, row_example = [], []
        for i, chains in enumerate(references):
            for chain in _as_chains(chains):
                ref_idx.append(idx(chain))
                row_example.append(i)
        steps = list(vocab) if self.step_gate == "facts" else None
        if self.exact:  # one id per distinct normalised string: equal ids are similarity 1
            self.last_encoded = 0
            forms: dict[str, int] = {}
            ids = [forms.setdefault(normalize_step(t), len(forms)) for t in vocab]
            table = torch.tensor(ids, dtype=torch.long).view(-1, 1)
            return self._score_rows(table, pred_idx, ref_idx, row_example, exact=True, steps=steps)
        table = self.embed(list(vocab))
        return self._score_rows(table, pred_idx, ref_idx, row_example, steps=steps)

    @torch.inference_mode()
    def score_embeddings(
        self,
        predicted: Sequence[torch.Tensor],
        references: Sequence[torch.Tensor | Sequence[torch.Tensor]],
    ) -> StepScores:
        """Like :meth:`score` for precomputed embeddings ``[n_i, d]`` (normalised inside).

        An empty side is a ``[0, d]`` (or ``[0]``) tensor and follows the same rules as an
        empty list in :meth:`score`. The step gate reads the steps' text, which embeddings lack:
        a gated scorer refuses.
        """
        if self.step_gate != "none":
            raise ValueError(
                f"step_gate={self.step_gate!r} reads the steps' text; score_embeddings has only "
                "embeddings: use score()"
            )
        if len(predicted) != len(references):
            raise ValueError(f"{len(predicted)} predictions but {len(references)} references")
        parts, pred_idx, ref_idx, row_example, offset = [], [], [], [], 0

        def add(t: torch.Tensor) -> list[int]:
            nonlocal offset
            if len(t) == 0:  # no steps: nothing to embed (reshape(0, -1) is ambiguous)
                return []
            parts.append(t.reshape(len(t), -1).to(self.device, torch.float32))
            offset += len(t)
            return list(range(offset - len(t), offset))

        for p in predicted:
            pred_idx.append(add(p))
        for i, r in enumerate(references):
            for chain in [r] if isinstance(r, torch.Tensor) else r:
                ref_idx.append(add(chain))
                row_example.append(i)
        table = torch.nn.functional.normalize(torch.cat(parts), dim=-1) if offset else torch.zeros(0, 1)
        return self._score_rows(table, pred_idx, ref_idx, row_example)

    @torch.inference_mode()
    def _score_rows(
        self, table, pred_idx, ref_idx, row_example, exact: bool = False, steps: Sequence[str] | None = None
    ) -> StepScores:
        """Core: one similarity batch for every (example, reference chain) row.

        Rows that share a reference chain (a GRPO group: every generation of one prompt)
        share one similarity block: each distinct chain is compared once with the union of
        its rows' predicted steps (one small bmm per chain instead of one per row, which
        dominated the cached path), and every row reads its ``[N, M]`` block from there.
        ``exact``: ``table`` holds one string id per text (``[T, 1]``) and a block entry is
        1.0 where the ids are equal, else 0.0. ``steps``: the texts (the step gate is on); a
        pair whose facts disagree gets similarity -inf, below any threshold.
        """
        n_examples = len(pred_idx)
        if n_examples == 0:
            empty = torch.zeros(0)
            return StepScores(
                empty, empty, empty, empty, empty, empty.long(), empty.long(), empty.long(), [], empty.long()
            )
        chains: dict[tuple[int, ...], int] = {}
        chain_ref: list[list[int]] = []
        chain_pred: list[dict[int, int]] = []  # text id -> position in the chain's block
        row_chain, row_loc = [], []
        for ref, ex in zip(ref_idx, row_example):
            c = chains.setdefault(tuple(ref), len(chains))
            if c == len(chain_ref):
                chain_ref.append(ref)
                chain_pred.append({})
            local = chain_pred[c]
            row_loc.append([local.setdefault(t, len(local)) for t in pred_idx[ex]])
            row_chain.append(c)
        dev = self.device
        rex = torch.tensor(row_example, dtype=torch.long)
        table = table.to(dev, torch.long if exact else torch.float32)
        if table.numel() == 0:
            table = torch.zeros(1, 1, device=dev, dtype=table.dtype)
        gather = lambda pad: table.index_select(0, pad.clamp(min=0).reshape(-1)).view(*pad.shape, table.shape[1])
        pred_text = _padded_index([list(m) for m in chain_pred], dev)[0]  # [C, U] text ids
        ref_text = _padded_index(chain_ref, dev)[0]  # [C, M]
        block_pred, block_ref = gather(pred_text), gather(ref_text)  # [C, U, d], [C, M, d]
        if exact:
            blocks = (block_pred[..., 0].unsqueeze(2) == block_ref[..., 0].unsqueeze(1)).float()  # [C, U, M]
        else:
            blocks = torch.bmm(block_pred, block_ref.transpose(1, 2))  # [C, U, M]
        if steps is not None:
            agree = gate_blocks(pred_text, ref_text, steps, self.rel_tol, self.abs_tol)
            blocks = blocks.masked_fill(~agree, float("-inf"))
        loc, n_pred = _padded_index(row_loc, dev)  # [R, N] positions in the row's block
        n_ref = torch.tensor([len(r) for r in ref_idx], dtype=torch.long, device=dev)
        sim = blocks[torch.tensor(row_chain, device=dev).view(-1, 1), loc.clamp(min=0)]  # [R, N, M]
        scores = match_similarities(sim, n_pred, n_ref, self.threshold, self.alpha, self.matcher)
        return best_per_example(scores, rex, n_examples)


def _as_chains(refs: References) -> list[Chain]:
    """A single chain becomes ``[chain]``; a list of chains stays as it is."""
    if len(refs) and not isinstance(refs[0], str):
        return [list(c) for c in refs]
    return [refs]

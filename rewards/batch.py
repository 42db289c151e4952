"""The one evaluation of completions (docs/method.md sections 1-4): what each completion says,
whether its answer is right, how its steps match the references, per row.

:func:`evaluate` is what :meth:`RewardModule.score <crystal_grpo.rewards.base.RewardModule.score>`
runs; everything a reward, a metric or a report needs is read from its :class:`Batch`, so a
batch is parsed, judged and embedded once. torch is imported where tensors are made.
"""

from __future__ import annotations

import dataclasses
import math
import typing
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from crystal_grpo.rewards.answers import answers_match
from crystal_grpo.rewards.parsing import ParsedOutput, parse_completion

if TYPE_CHECKING:
    import torch

    from crystal_grpo.rewards.match_f1 import MatchF1Scorer, StepScores

#: In a reward computed for training, a completion with more predicted steps than this scores
#: step metrics 0 (F1, precision and recall) without embedding any of its steps (thousands of
#: distinct steps would keep a reward call in the encoder for tens of seconds: docs/rewards.md,
#: "Hostile model output"). References have at most 42 steps in CRYSTAL (mean 11.6), so past this
#: cap precision is below 42/256 = 0.16 and F1 below 0.28 anyway: scoring 0 means the cap can never
#: raise a reward. The guard still sees the real step count, each step logs how many rows the cap
#: hit (``steps_capped``), and ``--check`` names data whose references are longer. A report
#: (validation, scripts/evaluate.py, crystal-grpo-score) scores every step it is given.
MAX_SCORED_STEPS = 256
StepMetric = Literal["f1", "ordered_f1"]
STEP_METRICS: tuple[str, ...] = typing.get_args(StepMetric)

FIELDS = ("correct", "format_ok", "has_refs", "n_pred", "step", "precision", "recall", "f1", "lis_ratio", "ordered_f1")
#: The step scores of a row (NaN without references; 0 for a malformed completion under ``malformed: zero``).
STEP_FIELDS = ("step", "precision", "recall", "f1", "ordered_f1")
#: Columns of a data row the evaluation reads (docs/method.md section 1); any other key is ignored.
COLUMNS = ("answer", "reference_steps", "reference_sets", "choices")


@dataclass
class Batch:
    """Per-row results of one generation batch: ``[B]`` float64 tensors on CPU.

    ``correct`` is C and ``format_ok`` is F (0/1); ``step`` is the configured step metric
    (F1 or Ordered F1). Step fields are NaN on rows without reference steps.
    """

    correct: torch.Tensor
    format_ok: torch.Tensor
    has_refs: torch.Tensor
    n_pred: torch.Tensor
    step: torch.Tensor
    precision: torch.Tensor
    recall: torch.Tensor
    f1: torch.Tensor
    lis_ratio: torch.Tensor
    ordered_f1: torch.Tensor
    #: ``[B, k]``: a reward's own per-row values (``RewardModule.extra_fields``), e.g. the
    #: authors' released rewards, computed from the text in ``score`` and gathered with the rest.
    extra: torch.Tensor | None = None

    def __len__(self) -> int:
        return len(self.correct)

    def as_tensor(self) -> torch.Tensor:
        """``[B, len(FIELDS) + k]`` float64: what one gather across processes moves."""
        import torch

        base = torch.stack([getattr(self, f) for f in FIELDS], dim=1)
        return base if self.extra is None else torch.cat([base, self.extra.to(base)], dim=1)

    @classmethod
    def from_tensor(cls, t: torch.Tensor, extra: int = 0) -> Batch:
        t = t.double().reshape(-1, len(FIELDS) + extra)
        return cls(**{f: t[:, i] for i, f in enumerate(FIELDS)}, extra=t[:, len(FIELDS) :] if extra else None)

    def rows(self) -> list[list[float]]:
        return self.as_tensor().tolist()

    @classmethod
    def from_rows(cls, rows: list[list[float]], extra: int = 0) -> Batch:
        import torch

        return cls.from_tensor(torch.tensor(rows, dtype=torch.float64).reshape(len(rows), len(FIELDS) + extra), extra)


@dataclass
class Scored:
    """One evaluation of completions (this process's rows), from :func:`evaluate`.

    ``batch`` holds the per-row numbers every reward and metric is made of; ``parsed`` what
    each completion says; ``steps`` the matching details (pairs, counts, winning chain) of
    the rows with references, which are ``step_rows`` (None when steps were not scored).
    """

    batch: Batch
    parsed: list[ParsedOutput]
    steps: StepScores | None
    step_rows: list[int]


def reference_chains(steps: Any, sets: Any) -> list[list[str]] | None:
    """The row's reference chains, or None when it has none (then step terms are skipped)."""
    chains = []
    for chain in ([steps] if steps else []) + (list(sets) if sets else []):
        chain = [str(s) for s in chain or [] if str(s).strip()]
        if chain and chain not in chains:
            chains.append(chain)
    return chains or None


def is_correct(predicted: str | None, truth: Any, choices: Any, opts: Mapping[str, Any]) -> bool:
    """C for one row; a malformed data cell scores 0 rather than stopping training."""
    if predicted is None or truth is None:
        return False
    try:
        return answers_match(
            predicted,
            truth if isinstance(truth, (int, float)) else str(truth),
            choices if isinstance(choices, (list, tuple)) else None,
            **opts,
        )
    except Exception:  # noqa: BLE001 - a reward must never crash training
        return False


def evaluate(
    completions: Sequence[Any],
    rows: Sequence[Mapping[str, Any]],
    *,
    scorer: MatchF1Scorer | None,
    step_metric: str,
    answer_options: Mapping[str, Any],
    max_steps: int | None = MAX_SCORED_STEPS,
) -> Scored:
    """Parse, check answers and (with a ``scorer``) match steps for these rows; no guard, no state.

    ``completions``: model output (text, TRL's message lists, anything: it never raises) or
    already parsed :class:`ParsedOutput`. ``rows``: one mapping per completion with the data
    columns (:data:`COLUMNS`). ``answer_options``: keyword arguments of ``answers_match``.
    ``max_steps``: a completion with more steps scores step metrics 0 (None: no cap).
    """
    import torch

    parsed = [c if isinstance(c, ParsedOutput) else parse_completion(c) for c in completions]
    n = len(parsed)
    col = {k: [r.get(k) if isinstance(r, Mapping) else None for r in rows] for k in COLUMNS}
    refs = (
        [reference_chains(s, sets) for s, sets in zip(col["reference_steps"], col["reference_sets"])]
        if scorer is not None
        else [None] * n
    )
    f64 = lambda xs: torch.tensor(xs, dtype=torch.float64).reshape(n)
    nan = lambda: torch.full((n,), math.nan, dtype=torch.float64)
    batch = Batch(
        correct=f64(
            [
                float(is_correct(p.answer, a, ch, answer_options))
                for p, a, ch in zip(parsed, col["answer"], col["choices"])
            ]
        ),
        format_ok=f64([float(p.format_ok) for p in parsed]),
        has_refs=f64([float(r is not None) for r in refs]),
        n_pred=f64([float(len(p.steps)) for p in parsed]),
        step=nan(),
        precision=nan(),
        recall=nan(),
        f1=nan(),
        lis_ratio=nan(),
        ordered_f1=nan(),
    )
    step_rows = [i for i, r in enumerate(refs) if r is not None]
    scores = None
    if step_rows:
        steps = [parsed[i].steps if max_steps is None or len(parsed[i].steps) <= max_steps else [] for i in step_rows]
        scores = scorer.score(steps, [refs[i] for i in step_rows])
        for f in ("precision", "recall", "f1", "lis_ratio", "ordered_f1"):
            getattr(batch, f)[step_rows] = getattr(scores, f).double()
        batch.step[step_rows] = getattr(batch, step_metric)[step_rows]
    return Scored(batch, parsed, scores, step_rows)


def zero_malformed(batch: Batch) -> Batch:
    """The batch with every completion that fails the format check neither correct nor matching
    any step (``malformed: zero``, CRYSTAL S6.3); rows without references keep NaN step scores."""
    bad = batch.format_ok == 0
    zeroed = lambda t: t.masked_fill(bad & ~t.isnan(), 0.0)
    return dataclasses.replace(
        batch, correct=batch.correct.masked_fill(bad, 0.0), **{f: zeroed(getattr(batch, f)) for f in STEP_FIELDS}
    )

"""What every reward module shares: one evaluation of a generation batch, TRL adapters.

TRL's GRPOTrainer calls each reward function separately with the same batch. A reward
here is a *module* made of named components, each tagged with the objective it serves
(``accuracy`` or ``reasoning``; PCGrad splits on that tag). The module evaluates a batch
once (parse, check answers, embed and match steps), and every component function reads
from that evaluation, so steps are embedded once per batch however many rewards use them.
"""

from __future__ import annotations

import math
import time
import typing
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch

from crystal_grpo.distributed import gather_objects
from crystal_grpo.rewards.answers import answers_match
from crystal_grpo.rewards.match_f1 import MatchF1Scorer
from crystal_grpo.rewards.parsing import parse_completion
from crystal_grpo.rewards.verbosity import VerbosityGuard

OBJECTIVES = ("accuracy", "reasoning")

#: A completion with more predicted steps than this scores step metrics 0 (F1, precision
#: and recall) without embedding any of its steps. Measured on 2 CPU cores, one completion
#: of 20,000 distinct short steps kept a reward call in the encoder for 46 s. References
#: have at most 42 steps in CRYSTAL (mean 11.6), so past this cap precision is below
#: 42/256 = 0.16 and F1 below 0.28 anyway: scoring 0 means the cap can never raise a
#: reward. The guard still sees the real step count.
MAX_SCORED_STEPS = 256
StepMetric = Literal["f1", "ordered_f1"]
STEP_METRICS: tuple[str, ...] = typing.get_args(StepMetric)

_SCORERS: dict[tuple, MatchF1Scorer] = {}


def shared_scorer(**settings: Any) -> MatchF1Scorer:
    """One scorer (one encoder, one cache) per process and settings."""
    key = tuple(sorted((k, v if isinstance(v, (str, int, float, bool, type(None))) else id(v))
                       for k, v in settings.items()))
    if key not in _SCORERS:
        _SCORERS[key] = MatchF1Scorer(**settings)
    return _SCORERS[key]


FIELDS = ("correct", "format_ok", "has_refs", "n_pred", "step",
          "precision", "recall", "f1", "lis_ratio", "ordered_f1")


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

    def __len__(self) -> int:
        return len(self.correct)

    def rows(self) -> list[list[float]]:
        return torch.stack([getattr(self, f) for f in FIELDS], dim=1).tolist()

    @classmethod
    def from_rows(cls, rows: list[list[float]]) -> "Batch":
        t = torch.tensor(rows, dtype=torch.float64).reshape(len(rows), len(FIELDS))
        return cls(**{f: t[:, i] for i, f in enumerate(FIELDS)})


def _chains(steps: Any, sets: Any) -> list[list[str]] | None:
    """The row's reference chains, or None when it has none (then step terms are skipped)."""
    chains = []
    for chain in ([steps] if steps else []) + (list(sets) if sets else []):
        chain = [str(s) for s in chain or [] if str(s).strip()]
        if chain and chain not in chains:
            chains.append(chain)
    return chains or None


def _correct(predicted: str | None, truth: Any, choices: Any, opts: dict) -> bool:
    """C for one row; a malformed data cell scores 0 rather than stopping training."""
    if predicted is None or truth is None:
        return False
    try:
        return answers_match(predicted, truth if isinstance(truth, (int, float)) else str(truth),
                             choices if isinstance(choices, (list, tuple)) else None, **opts)
    except Exception:  # noqa: BLE001 - a reward must never crash training
        return False


def evaluate(
    completions: Sequence[Any],
    answers: Sequence[Any],
    references: Sequence[list[list[str]] | None],
    choices: Sequence[Any],
    scorer: MatchF1Scorer | None,
    step_metric: str = "f1",
    answer_options: dict | None = None,
) -> Batch:
    """Parse, check answers and score steps for this process's rows."""
    parsed = [parse_completion(c) for c in completions]
    opts = answer_options or {}
    n = len(parsed)
    f64 = lambda xs: torch.tensor(xs, dtype=torch.float64).reshape(n)  # noqa: E731
    nan = lambda: torch.full((n,), math.nan, dtype=torch.float64)  # noqa: E731
    batch = Batch(
        correct=f64([float(_correct(p.answer, a, ch, opts)) for p, a, ch in zip(parsed, answers, choices)]),
        format_ok=f64([float(p.format_ok) for p in parsed]),
        has_refs=f64([float(r is not None) for r in references]),
        n_pred=f64([float(len(p.steps)) for p in parsed]),
        step=nan(), precision=nan(), recall=nan(), f1=nan(), lis_ratio=nan(), ordered_f1=nan(),
    )
    rows = [i for i, r in enumerate(references) if r is not None]
    if scorer is not None and rows:
        steps = [parsed[i].steps if len(parsed[i].steps) <= MAX_SCORED_STEPS else [] for i in rows]
        scores = scorer.score(steps, [references[i] for i in rows])
        for f in ("precision", "recall", "f1", "lis_ratio", "ordered_f1"):
            getattr(batch, f)[rows] = getattr(scores, f).double()
        batch.step[rows] = getattr(batch, step_metric)[rows]
    return batch


class RewardModule:
    """A reward made of named, objective-tagged components whose sum is the reward.

    Subclasses set ``name``, ``objectives`` (component -> objective), ``uses_steps`` and
    implement :meth:`components`. Everything else (TRL adapters, the verbosity guard,
    diagnostics, state for checkpoints) lives here.
    """

    name: str = ""
    objectives: dict[str, str] = {}
    uses_steps: bool = True

    def __init__(
        self,
        *,
        encoder: Any = "packaged:all-MiniLM-L6-v2",
        threshold: float = 0.35,
        order_alpha: float = 0.3,
        matcher: Literal["greedy", "dp"] = "greedy",
        step_metric: StepMetric = "f1",
        device: str | None = None,
        scorer_batch_size: int = 128,
        cache_size: int = 50_000,
        verbosity_guard: bool | None = None,
        guard_k: float = 2.0,
        guard_window: int = 1024,
        guard_factor: float = 0.5,
        guard_min_history: int = 64,
        rel_tol: float = 1e-2,
        abs_tol: float = 1e-6,
        judge: Callable[[str, str], bool] | None = None,
    ) -> None:
        if step_metric not in STEP_METRICS:
            raise ValueError(f"step_metric={step_metric!r}: allowed values are {', '.join(STEP_METRICS)}")
        self.step_metric = step_metric
        self.scorer = (
            shared_scorer(encoder=encoder, threshold=threshold, alpha=order_alpha, matcher=matcher,
                          device=device, batch_size=scorer_batch_size, cache_size=cache_size)
            if self.uses_steps else None
        )
        use_guard = self.uses_steps if verbosity_guard is None else verbosity_guard
        self.guard = (VerbosityGuard(guard_k, guard_window, guard_factor, guard_min_history)
                      if use_guard else None)
        self.answer_options = {"rel_tol": rel_tol, "abs_tol": abs_tol, "judge": judge}
        self._last: tuple[Any, dict[str, list]] | None = None

    # -- to implement -----------------------------------------------------------------
    def components(self, batch: Batch) -> dict[str, torch.Tensor]:
        """Per-row component values for the *global* batch (NaN = not applicable)."""
        raise NotImplementedError

    # -- TRL interface ----------------------------------------------------------------
    def reward_funcs(self) -> list[Callable[..., list[float | None]]]:
        """One TRL reward function per component; their unweighted sum is the reward."""
        funcs = []
        for comp, objective in self.objectives.items():
            assert objective in OBJECTIVES, (comp, objective)

            def func(prompts=None, completions=None, _comp=comp, **kwargs):
                return self(completions, **kwargs)[_comp]

            func.__name__ = func.__qualname__ = comp
            func.objective = objective  # type: ignore[attr-defined]
            func.reward_module = self  # type: ignore[attr-defined]
            funcs.append(func)
        return funcs

    def __call__(self, completions: Sequence[Any], **kwargs: Any) -> dict[str, list[float | None]]:
        """Evaluate once per batch (memoised on the completions list TRL passes to every
        function) and return every component for this process's rows."""
        if self._last is not None and self._last[0] is completions:
            return self._last[1]
        out = self._evaluate(completions, kwargs)
        self._last = (completions, out)
        return out

    def _evaluate(self, completions: Sequence[Any], kwargs: dict) -> dict[str, list[float | None]]:
        start = time.perf_counter()
        n = len(completions)
        col = lambda k: list(kwargs.get(k) or [None] * n)  # noqa: E731
        refs = ([_chains(s, r) for s, r in zip(col("reference_steps"), col("reference_sets"))]
                if self.uses_steps else [None] * n)
        local = evaluate(completions, col("answer"), refs, col("choices"), self.scorer,
                         self.step_metric, self.answer_options)
        # Each process scores its own slice; the per-row results are then shared so that
        # composite statistics, the guard's median and the diagnostics are global.
        rows, offset = gather_objects(local.rows())
        batch = Batch.from_rows(rows)
        comps = self.components(batch)
        flagged = torch.zeros(len(batch), dtype=torch.bool)
        if self.guard is not None:
            flagged = self.guard.step(batch.n_pred)
            comps = {k: self.guard.apply(v, flagged) for k, v in comps.items()}
        metrics = diagnostics(batch, comps, flagged)
        metrics["scoring_seconds"] = time.perf_counter() - start
        log_metric = kwargs.get("log_metric")
        if log_metric is not None:
            for key, value in metrics.items():
                if math.isfinite(value):
                    log_metric(f"{self.name}/{key}", value)
        self.last_metrics = metrics
        mine = slice(offset, offset + n)
        return {k: [None if math.isnan(x) else x for x in v[mine].tolist()] for k, v in comps.items()}

    # -- checkpoint state -------------------------------------------------------------
    def state_dict(self) -> dict:
        return {"guard": self.guard.state_dict() if self.guard else None}

    def load_state_dict(self, state: dict) -> None:
        if self.guard is not None and state.get("guard"):
            self.guard.load_state_dict(state["guard"])


def _pearson(x: torch.Tensor, y: torch.Tensor) -> float:
    if len(x) < 2:
        return math.nan
    x, y = x - x.mean(), y - y.mean()
    denom = (x.square().sum() * y.square().sum()).sqrt()
    return float((x * y).sum() / denom) if denom > 0 else math.nan


def diagnostics(batch: Batch, comps: dict[str, torch.Tensor], flagged: torch.Tensor) -> dict[str, float]:
    """SPEC section 6 diagnostics over the global batch (NaN where undefined)."""
    total = torch.stack(list(comps.values())).nansum(dim=0) if comps else torch.zeros(len(batch))
    c = batch.correct.bool()
    refs = batch.has_refs.bool()
    mean = lambda t: float(t.mean()) if len(t) else math.nan  # noqa: E731
    out = {
        "accuracy": mean(batch.correct),
        "format_rate": mean(batch.format_ok),
        "steps_mean": mean(batch.n_pred),
        "steps_median": float(batch.n_pred.median()) if len(batch) else math.nan,
        "guard_rate": mean(flagged.double()),
        "discrimination_gap": mean(total[c]) - mean(total[~c]),
    }
    if bool(refs.any()):
        for f in ("precision", "recall", "f1", "lis_ratio", "ordered_f1"):
            out[f] = mean(getattr(batch, f)[refs])
        out["r_f1"] = _pearson(total[refs], batch.step[refs])
    return out

"""What every reward module shares: the one evaluation of completions, and what is made of it.

A reward is a *module* made of named components, each tagged with the objective it serves
(``accuracy`` or ``reasoning``; PCGrad splits on that tag), whose sum is the reward. A
batch is evaluated once (:meth:`RewardModule.score`: parse, check answers, embed and match
steps) and everything reads from that: the training rewards (:meth:`RewardModule.rewards`,
over the batch of all processes), validation and evaluation metrics
(:meth:`RewardModule.metrics`) and the scorer CLI.

torch is imported where tensors are made, not at the top: a run config is checked against
the reward's config class (``train/grpo.py --check``) without loading torch.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import time
import typing
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, Union

from crystal_grpo.distributed import gather_objects
from crystal_grpo.rewards.answers import answers_match
from crystal_grpo.rewards.encoder import PACKAGED_MINILM, PAPER_ENCODER
from crystal_grpo.rewards.parsing import ParsedOutput, parse_completion
from crystal_grpo.rewards.verbosity import VerbosityGuard
from crystal_grpo.metrics import VALIDATION
from crystal_grpo.typed import ConfigError, from_dict, option

if TYPE_CHECKING:
    import torch

    from crystal_grpo.rewards.match_f1 import MatchF1Scorer, StepScores

#: What a reward component serves; PCGrad splits the advantage on it (docs/method.md section 6).
Objective = Literal["accuracy", "reasoning"]
OBJECTIVES: tuple[str, ...] = typing.get_args(Objective)
#: What validation and evaluation report, in this order (``RewardModule.metrics``): the
#: metric table's ``reward`` rows (crystal_grpo/metrics.py).
METRICS: tuple[str, ...] = VALIDATION

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
        from crystal_grpo.rewards.match_f1 import MatchF1Scorer

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
    def from_tensor(cls, t: torch.Tensor, extra: int = 0) -> "Batch":
        t = t.double().reshape(-1, len(FIELDS) + extra)
        return cls(**{f: t[:, i] for i, f in enumerate(FIELDS)}, extra=t[:, len(FIELDS):] if extra else None)

    def rows(self) -> list[list[float]]:
        return self.as_tensor().tolist()

    @classmethod
    def from_rows(cls, rows: list[list[float]], extra: int = 0) -> "Batch":
        import torch

        return cls.from_tensor(torch.tensor(rows, dtype=torch.float64).reshape(len(rows), len(FIELDS) + extra), extra)


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


@dataclass
class Scored:
    """One evaluation of completions (this process's rows), from :meth:`RewardModule.score`.

    ``batch`` holds the per-row numbers every reward and metric is made of; ``parsed`` what
    each completion says; ``steps`` the matching details (pairs, counts, winning chain) of
    the rows with references, which are ``step_rows`` (None when steps were not scored).
    """

    batch: Batch
    parsed: list[ParsedOutput]
    steps: StepScores | None
    step_rows: list[int]


#: Columns of a data row the evaluation reads (docs/method.md section 1); any other key is ignored.
COLUMNS = ("answer", "reference_steps", "reference_sets", "choices")


@dataclass
class RewardConfig:
    """Settings every reward module shares (``reward.params`` of a run config); a module's own
    weights are fields of its subclass (e.g. ``CPRConfig`` in rewards/cpr.py)."""

    encoder: Any = option(PACKAGED_MINILM, "Sentence encoder for Match F1: hub id (local cache only offline), "
                          "local folder, or 'packaged:all-MiniLM-L6-v2'; or 'exact': two steps match when their "
                          "normalised strings are equal (no model; for formal steps). The paper: " + PAPER_ENCODER + ".")
    threshold: float = option(0.35, "tau: minimum cosine similarity for two steps to match.", ge=-1, le=1)
    order_alpha: float = option(0.3, "Weight of the order (LIS) term in Ordered Match F1.", ge=0, le=1)
    matcher: Literal["greedy", "dp"] = option("greedy", "greedy 1:1 matching (the paper) or dp (order-preserving).")
    step_metric: StepMetric = option("f1", "The step score rewards use: Match F1 or Ordered Match F1.")
    device: Union[str, None] = option(None, "Encoder device (None: CUDA when available).")
    scorer_batch_size: int = option(128, "Encoder batch size.", ge=1)
    cache_size: int = option(50_000, "Step embeddings kept across batches (LRU; 0: none).", ge=0)
    verbosity_guard: Union[bool, None] = option(None, "Penalise over-long step lists (None: on when the reward "
                                               "scores steps).")
    guard_k: float = option(2.0, "The guard flags more than k x the running median step count.", gt=0)
    guard_window: int = option(1024, "How many recent step counts the median is over.", ge=1)
    guard_factor: float = option(0.5, "A flagged completion keeps this share of its reward.", ge=0, le=1)
    guard_min_history: int = option(64, "Counts the window needs before the guard acts.", ge=1)
    rel_tol: float = option(1e-2, "Relative tolerance of numeric answers.", ge=0)
    abs_tol: float = option(1e-6, "Absolute tolerance of numeric answers.", ge=0)
    malformed: Union[Literal["zero", "lenient"], None] = option(
        None, "What a completion that fails the format check earns. zero: its answer and steps count 0, so it "
        "gets the minimal reward (CRYSTAL S6.3: 'Malformed outputs receive F=0 and minimal reward but still "
        "contribute gradients'); lenient: the answer and steps read leniently from it count. None: zero for "
        "rewards with a reasoning component (CPR, composite), lenient for the others. Validation and evaluation metrics read leniently "
        "either way, so every arm is measured alike.")
    negative_weights: bool = option(False, "Allow negative reward weights (a penalty term on purpose); without "
                                    "this a negative weight is refused as a likely typo.")


class RewardModule:
    """A reward made of named, objective-tagged components whose sum is the reward.

    Subclasses set ``name``, ``objectives`` (component -> objective), ``uses_steps``,
    ``config_class`` (a :class:`RewardConfig` subclass holding their own weights, under the
    names configs use) and implement :meth:`components`. The rest is shared: :meth:`score` (the one evaluation of
    completions, used by training, validation and the CLIs), :meth:`rewards` (components
    with the verbosity guard, and the diagnostics), :meth:`metrics` (the ``METRICS``),
    checkpoint state, and :meth:`reward_funcs` for a plain ``trl.GRPOTrainer``.
    """

    name: str = ""
    objectives: dict[str, Objective] = {}
    uses_steps: bool = True
    config_class: type[RewardConfig] = RewardConfig
    #: Names of the reward's own per-row values that ``score`` puts in ``Batch.extra``.
    extra_fields: tuple[str, ...] = ()

    def __init__(self, config: RewardConfig | None = None, *, judge: Callable[[str, str], bool] | None = None,
                 **params: Any) -> None:
        """``config`` (this class's ``config_class``) or its fields as keyword parameters;
        ``judge`` is an optional ``(predicted, truth) -> bool`` for free-form answers."""
        self.config = config if config is not None else self.make_config(params)
        cfg = self.config
        bad = {c: o for c, o in self.objectives.items() if o not in OBJECTIVES}
        if bad:
            raise ValueError(f"{type(self).__name__}.objectives {bad}: each must be one of {OBJECTIVES}")
        self.step_metric = cfg.step_metric
        self._scorer_settings = dict(encoder=cfg.encoder, threshold=cfg.threshold, alpha=cfg.order_alpha,
                                     matcher=cfg.matcher, device=cfg.device, batch_size=cfg.scorer_batch_size,
                                     cache_size=cfg.cache_size)
        self.scorer = shared_scorer(**self._scorer_settings) if self.uses_steps else None
        use_guard = self.uses_steps if cfg.verbosity_guard is None else cfg.verbosity_guard
        self.guard = (VerbosityGuard(cfg.guard_k, cfg.guard_window, cfg.guard_factor, cfg.guard_min_history)
                      if use_guard else None)
        self.answer_options = {"rel_tol": cfg.rel_tol, "abs_tol": cfg.abs_tol, "judge": judge}
        rewards_steps = "reasoning" in self.objectives.values()
        self.malformed = cfg.malformed or ("zero" if rewards_steps else "lenient")
        self.last_metrics: dict[str, float] = {}
        self._last: tuple[Any, dict[str, list]] | None = None

    @classmethod
    def make_config(cls, params: Mapping[str, Any], where: str = "reward.params") -> RewardConfig:
        """This reward's typed config from its parameters (``reward.params`` of a run config):
        an unknown name or a bad value is a one-line error naming it."""
        names = [f.name for f in dataclasses.fields(cls.config_class)]
        unknown = sorted(set(params) - set(names))
        if unknown:
            near = difflib.get_close_matches(unknown[0], names, n=1)
            hint = f": did you mean {near[0]!r}?" if near else ""
            raise ConfigError(f"{where}: unknown key(s) {', '.join(map(repr, unknown))} for reward {cls.name!r} "
                              f"(unknown parameter {unknown[0]!r}{hint}); allowed: {', '.join(sorted(names))}")
        config = from_dict(cls.config_class, dict(params), where)
        if not config.negative_weights:
            for f in dataclasses.fields(config):
                value = getattr(config, f.name)
                if f.metadata.get("weight") and isinstance(value, (int, float)) and value < 0:
                    raise ConfigError(f"{where}.{f.name}: invalid value {value!r}; a reward weight must be >= 0 (set "
                                      f"{where}.negative_weights: true if the penalty is meant)")
        return config

    # -- to implement -----------------------------------------------------------------
    def components(self, batch: Batch) -> dict[str, torch.Tensor]:
        """Per-row component values for the *global* batch (NaN = not applicable)."""
        raise NotImplementedError

    # -- the one evaluation -----------------------------------------------------------
    def score(self, completions: Sequence[Any], rows: Sequence[Mapping[str, Any]],
              with_steps: bool | None = None) -> Scored:
        """Parse, check answers and match steps for these rows; no guard, no state.

        ``completions``: model output (text, TRL's message lists, anything: it never
        raises) or already parsed :class:`ParsedOutput`. ``rows``: one mapping per
        completion with the data columns (``answer``, ``reference_steps``, optional
        ``reference_sets`` and ``choices``). Steps are scored when the reward uses them, or
        when ``with_steps`` asks (validation reports Match F1 for every reward).
        """
        import torch

        parsed = [c if isinstance(c, ParsedOutput) else parse_completion(c) for c in completions]
        n = len(parsed)
        col = {k: [r.get(k) if isinstance(r, Mapping) else None for r in rows] for k in COLUMNS}
        scorer = self._scorer() if (self.uses_steps if with_steps is None else with_steps) else None
        refs = ([_chains(s, sets) for s, sets in zip(col["reference_steps"], col["reference_sets"])]
                if scorer is not None else [None] * n)
        opts = self.answer_options
        f64 = lambda xs: torch.tensor(xs, dtype=torch.float64).reshape(n)  # noqa: E731
        nan = lambda: torch.full((n,), math.nan, dtype=torch.float64)  # noqa: E731
        batch = Batch(
            correct=f64([float(_correct(p.answer, a, ch, opts))
                         for p, a, ch in zip(parsed, col["answer"], col["choices"])]),
            format_ok=f64([float(p.format_ok) for p in parsed]),
            has_refs=f64([float(r is not None) for r in refs]),
            n_pred=f64([float(len(p.steps)) for p in parsed]),
            step=nan(), precision=nan(), recall=nan(), f1=nan(), lis_ratio=nan(), ordered_f1=nan(),
        )
        step_rows = [i for i, r in enumerate(refs) if r is not None]
        scores = None
        if step_rows:
            steps = [parsed[i].steps if len(parsed[i].steps) <= MAX_SCORED_STEPS else [] for i in step_rows]
            scores = scorer.score(steps, [refs[i] for i in step_rows])
            for f in ("precision", "recall", "f1", "lis_ratio", "ordered_f1"):
                getattr(batch, f)[step_rows] = getattr(scores, f).double()
            batch.step[step_rows] = getattr(batch, self.step_metric)[step_rows]
        return Scored(batch, parsed, scores, step_rows)

    def rewards(self, batch: Batch, guard: bool = True) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
        """Components of a GLOBAL batch (all processes) and the docs/method.md section 6 diagnostics.

        With ``guard`` the verbosity guard judges the batch and then adds it to its window
        (call it once per generation batch); without, the components are the plain ones.
        """
        import torch

        comps = self.components(self.as_rewarded(batch))
        flagged = torch.zeros(len(batch), dtype=torch.bool)
        if guard and self.guard is not None:
            flagged = self.guard.step(batch.n_pred)
            comps = {k: self.guard.apply(v, flagged) for k, v in comps.items()}
        self.last_metrics = diagnostics(batch, comps, flagged)
        return comps, self.last_metrics

    def total(self, batch: Batch) -> torch.Tensor:
        """Each row's reward without the guard (the sum of its applicable components)."""
        return _total(self.components(self.as_rewarded(batch)), len(batch))

    def as_rewarded(self, batch: Batch) -> Batch:
        """The batch as the reward sees it: with ``malformed: zero`` a completion that fails the
        format check is neither correct nor has a step score (the metrics keep the lenient reading)."""
        if self.malformed != "zero":
            return batch
        bad = batch.format_ok == 0
        zeroed = lambda t: t.masked_fill(bad & ~t.isnan(), 0.0)  # noqa: E731
        return dataclasses.replace(batch, correct=batch.correct.masked_fill(bad, 0.0),
                                   **{f: zeroed(getattr(batch, f)) for f in ("step", "precision", "recall", "f1",
                                                                              "ordered_f1")})

    def metrics(self, batch: Batch) -> dict[str, float]:
        """The :data:`METRICS` of a batch: what validation and evaluation report."""
        per_row = {"accuracy": batch.correct, "format_rate": batch.format_ok, "steps_mean": batch.n_pred,
                   "reward": self.total(batch)}
        return {m: _nanmean(per_row[m] if m in per_row else getattr(batch, m)) for m in METRICS}

    def pin_references(self, rows: Any) -> int:
        """Embed every reference step of ``rows`` (a ``datasets.Dataset`` or a list of
        mappings) once, before training, when this reward scores steps
        (:meth:`MatchF1Scorer.pin`). Returns how many texts were encoded."""
        if not self.uses_steps:
            return 0
        names = getattr(rows, "column_names", None)
        column = ((lambda k: rows[k] if k in names else [None] * len(rows)) if names is not None
                  else (lambda k: [r.get(k) for r in rows]))
        chains = map(_chains, column("reference_steps"), column("reference_sets"))
        return self._scorer().pin(step for cs in chains for chain in cs or [] for step in chain)

    def _scorer(self) -> MatchF1Scorer:
        if self.scorer is None:  # a reward without step terms, asked for Match F1 (validation)
            self.scorer = shared_scorer(**self._scorer_settings)
        return self.scorer

    # -- plain TRL ----------------------------------------------------------------------
    def reward_funcs(self) -> list[Callable[..., list[float | None]]]:
        """One reward function per component, named after it, for a plain ``trl.GRPOTrainer``.

        TRL calls each function separately on the same batch, so the first call evaluates
        the batch (:meth:`score`, gathered across processes, :meth:`rewards`) and the
        others read that result, recognised by the identity of the completions list TRL
        passes to all of them. ``CrystalGRPOTrainer`` does not call these: it evaluates
        once itself (``_calculate_rewards``) and uses them for the names only.
        """
        funcs = []
        for comp, objective in self.objectives.items():

            def func(prompts=None, completions=None, _comp=comp, **kwargs):
                return self._plain_trl_call(prompts, completions, kwargs)[_comp]

            func.__name__ = func.__qualname__ = comp
            func.objective = objective  # type: ignore[attr-defined]
            funcs.append(func)
        return funcs

    def _plain_trl_call(self, prompts: Any, completions: Sequence[Any], kwargs: dict) -> dict[str, list[float | None]]:
        if self._last is not None and self._last[0] is completions:
            return self._last[1]
        start = time.perf_counter()
        n = len(completions)
        # every column TRL passes (a composed reward's own functions read any of them)
        columns = {k: v for k, v in {"prompt": prompts, **kwargs}.items() if isinstance(v, list) and len(v) == n}
        rows = [{k: v[i] for k, v in columns.items()} for i in range(n)]
        local = self.score(completions, rows).batch
        gathered, offset = gather_objects(local.rows())
        comps, metrics = self.rewards(Batch.from_rows(gathered, len(self.extra_fields)))
        metrics["scoring_seconds"] = time.perf_counter() - start
        if kwargs.get("log_metric") is not None:
            for key, value in metrics.items():
                if math.isfinite(value):
                    kwargs["log_metric"](f"{self.name}/{key}", value)
        mine = slice(offset, offset + n)
        out = {k: [None if math.isnan(x) else x for x in v[mine].tolist()] for k, v in comps.items()}
        self._last = (completions, out)
        return out

    # -- checkpoint state -------------------------------------------------------------
    def state_dict(self) -> dict:
        return {"guard": self.guard.state_dict() if self.guard else None}

    def load_state_dict(self, state: dict) -> None:
        if self.guard is not None and state.get("guard"):
            self.guard.load_state_dict(state["guard"])


def _nanmean(t: torch.Tensor) -> float:
    known = t[~t.isnan()]
    return float(known.mean()) if len(known) else math.nan


def _total(comps: dict[str, torch.Tensor], n: int) -> torch.Tensor:
    """The reward: the sum of the components, a not-applicable (NaN) component counting 0."""
    import torch

    return torch.stack(list(comps.values())).nansum(dim=0) if comps else torch.zeros(n, dtype=torch.float64)


def _pearson(x: torch.Tensor, y: torch.Tensor) -> float:
    if len(x) < 2:
        return math.nan
    x, y = x - x.mean(), y - y.mean()
    denom = (x.square().sum() * y.square().sum()).sqrt()
    return float((x * y).sum() / denom) if denom > 0 else math.nan


def diagnostics(batch: Batch, comps: dict[str, torch.Tensor], flagged: torch.Tensor) -> dict[str, float]:
    """docs/method.md section 6 diagnostics over the global batch (NaN where undefined)."""
    total = _total(comps, len(batch))
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

"""What every reward module shares: the base class, :class:`RewardModule`, and its settings.

A reward is a *module* of named components, each tagged with the objective it serves
(``accuracy`` or ``reasoning``; PCGrad splits on that tag), whose sum is the reward. A batch is
evaluated once (:meth:`RewardModule.score`) and everything reads from that: the training rewards,
validation and evaluation metrics and the scorer CLI. Each concept has its own module, its names
importable from here too: the evaluation and its :class:`Batch` (rewards/batch.py), the reward
of a batch and the step diagnostics (rewards/diagnostics.py), the verbosity guard
(rewards/verbosity.py), the module as TRL reward functions (rewards/trl_functions.py). torch is
imported where tensors are made, so ``--check`` validates a reward's config without it.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import typing
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, Union

from crystal_grpo.errors import CrystalError
from crystal_grpo.metrics import VALIDATION
from crystal_grpo.metrics import names as metric_names
from crystal_grpo.rewards.batch import (  # noqa: F401 - the evaluation's names, importable from here too
    COLUMNS,
    FIELDS,
    MAX_SCORED_STEPS,
    STEP_METRICS,
    Batch,
    Scored,
    StepMetric,
    evaluate,
    reference_chains,
    zero_malformed,
)
from crystal_grpo.rewards.diagnostics import diagnostics, nanmean, total
from crystal_grpo.rewards.encoder import PACKAGED_MINILM, PAPER_ENCODER
from crystal_grpo.rewards.facts import StepGate
from crystal_grpo.rewards.step_credit import StepCreditConfig
from crystal_grpo.rewards.trl_functions import TRLRewardFunctions
from crystal_grpo.rewards.verbosity import VerbosityGuard
from crystal_grpo.typed import ConfigError, from_dict, option

if TYPE_CHECKING:
    import torch

    from crystal_grpo.rewards.match_f1 import MatchF1Scorer

#: What a reward component serves; PCGrad splits the advantage on it (docs/method.md section 6).
Objective = Literal["accuracy", "reasoning"]
OBJECTIVES: tuple[str, ...] = typing.get_args(Objective)
#: What validation and evaluation report, in this order (``RewardModule.metrics``): the
#: metric table's own ``reward`` rows (crystal_grpo/metrics.py; rows registered from outside the
#: package are in ``metrics.names("reward")``, which ``RewardModule.metrics`` reads).
METRICS: tuple[str, ...] = VALIDATION

_SCORERS: dict[tuple, MatchF1Scorer] = {}

#: The largest magnitude a reward value may have (docs/rewards.md, "What a reward returns"). TRL
#: computes a group's mean and std in float32: past about 1e18 the variance overflows (1e308 is
#: already inf in float32) and every advantage is NaN, so nothing learns and nothing says why.
MAX_REWARD = 1e15


class RewardFunctionError(CrystalError, ValueError):
    """A reward (a user's function or module) gave something that is not one usable number (or
    None) a completion; the message names the function, the row and the value."""


def value_problem(value: float) -> str | None:
    """Why ``value`` cannot be a reward (infinite, or beyond :data:`MAX_REWARD`), else None. NaN
    passes: a module's NaN is "not applicable" (None in TRL); a user function's NaN is refused
    where it is returned (rewards/user.py), where it cannot be told from None."""
    if math.isinf(value) or abs(value) > MAX_REWARD:
        return (
            f"{value!r} (a reward value must be finite and at most {MAX_REWARD:g} in magnitude: TRL's float32 "
            "group statistics cannot hold it)"
        )
    return None


def shared_scorer(**settings: Any) -> MatchF1Scorer:
    """One scorer (one encoder, one cache) per process and settings."""
    key = tuple(
        sorted((k, v if isinstance(v, (str, int, float, bool, type(None))) else id(v)) for k, v in settings.items())
    )
    if key not in _SCORERS:
        from crystal_grpo.rewards.match_f1 import MatchF1Scorer

        _SCORERS[key] = MatchF1Scorer(**settings)
    return _SCORERS[key]


@dataclass
class RewardConfig:
    """Settings every reward module shares (``reward.params`` of a run config); a module's own
    weights are fields of its subclass (e.g. ``CPRConfig`` in rewards/cpr.py)."""

    encoder: Any = option(
        PACKAGED_MINILM,
        "Sentence encoder for Match F1: hub id, local folder, 'packaged:all-MiniLM-L6-v2', or 'exact' "
        "(equal normalised strings match; the paper used " + PAPER_ENCODER + ").",
    )
    threshold: float = option(0.35, "tau: minimum cosine similarity for two steps to match.", ge=-1, le=1)
    order_alpha: float = option(0.3, "Weight of the order (LIS) term in Ordered Match F1.", ge=0, le=1)
    matcher: Literal["greedy", "dp"] = option("greedy", "greedy 1:1 matching (the paper) or dp (order-preserving).")
    step_gate: StepGate = option(
        "none",
        "facts: steps whose numbers, operators and variables disagree never match (docs/rewards.md); "
        "none: the encoder's similarity alone.",
    )
    step_metric: StepMetric = option("f1", "The step score rewards use: Match F1 or Ordered Match F1.")
    device: Union[str, None] = option(None, "Encoder device (None: CUDA when available).")
    scorer_batch_size: int = option(128, "Encoder batch size.", ge=1)
    cache_size: int = option(50_000, "Step embeddings kept across batches (LRU; 0: none).", ge=0)
    verbosity_guard: Union[bool, None] = option(
        None, "Penalise over-long step lists (None: on when the reward scores steps)."
    )
    guard_k: float = option(2.0, "The guard flags more than k x the running median step count.", gt=0)
    guard_window: int = option(1024, "How many recent step counts the median is over.", ge=1)
    guard_factor: float = option(0.5, "A flagged completion keeps this share of its reward.", ge=0, le=1)
    guard_min_history: int = option(64, "Counts the window needs before the guard acts.", ge=1)
    rel_tol: float = option(1e-2, "Relative tolerance of numeric answers (and of the step gate's numbers).", ge=0)
    abs_tol: float = option(1e-6, "Absolute tolerance of numeric answers (and of the step gate's numbers).", ge=0)
    malformed: Union[Literal["zero", "lenient"], None] = option(
        None,
        "What a completion failing the format check earns: zero (the minimal reward, CRYSTAL S6.3) or lenient "
        "(its leniently read answer and steps count); None: zero for rewards that score steps (docs/rewards.md).",
    )
    negative_weights: bool = option(
        False,
        "Allow negative reward weights (a penalty on purpose), otherwise refused as a likely typo.",
    )


class RewardModule:
    """A reward made of named, objective-tagged components whose sum is the reward.

    Subclasses set ``name``, ``objectives`` (component -> objective), ``uses_steps``,
    ``config_class`` (a :class:`RewardConfig` subclass holding their own weights, under the
    names configs use) and implement :meth:`components`. The rest is shared: :meth:`score`
    (the one evaluation of completions, used by training, validation and the CLIs),
    :meth:`rewards` (components with the verbosity guard, and the diagnostics),
    :meth:`per_row` and :meth:`metrics` (what the metric table's rows read), checkpoint
    state, and :meth:`reward_funcs` for a plain ``trl.GRPOTrainer``.
    """

    name: str = ""
    objectives: dict[str, Objective] = {}
    uses_steps: bool = True
    config_class: type[RewardConfig] = RewardConfig
    #: Names of the reward's own per-row values that ``score`` puts in ``Batch.extra``.
    extra_fields: tuple[str, ...] = ()
    #: The component that pays for a correct answer. Its raw correctness (:meth:`outcome`) is what
    #: dynamic sampling's ``metric: outcome`` gates on; None: the reward has none (that metric is refused).
    outcome_component: str | None = None

    def __init__(
        self,
        config: RewardConfig | None = None,
        *,
        judge: Callable[[str, str], bool] | None = None,
        step_credit: StepCreditConfig | None = None,
        **params: Any,
    ) -> None:
        """``config`` (this class's ``config_class``) or its fields as keyword parameters;
        ``judge`` is an optional ``(predicted, truth) -> bool`` for free-form answers;
        ``step_credit`` credits each step's tokens in the trainer (``reward.step_credit``), which
        scores the steps whatever the reward pays for."""
        self.config = config if config is not None else self.make_config(params)
        self.step_credit = step_credit or StepCreditConfig()
        cfg = self.config
        bad = {c: o for c, o in self.objectives.items() if o not in OBJECTIVES}
        if bad:
            raise ValueError(f"{type(self).__name__}.objectives {bad}: each must be one of {OBJECTIVES}")
        self.step_metric = cfg.step_metric
        self._scorer_settings = dict(
            encoder=cfg.encoder,
            threshold=cfg.threshold,
            alpha=cfg.order_alpha,
            matcher=cfg.matcher,
            device=cfg.device,
            batch_size=cfg.scorer_batch_size,
            cache_size=cfg.cache_size,
            step_gate=cfg.step_gate,
            rel_tol=cfg.rel_tol,
            abs_tol=cfg.abs_tol,
        )
        self.scorer = shared_scorer(**self._scorer_settings) if self.scores_steps else None
        use_guard = self.uses_steps if cfg.verbosity_guard is None else cfg.verbosity_guard
        self.guard = (
            VerbosityGuard(cfg.guard_k, cfg.guard_window, cfg.guard_factor, cfg.guard_min_history)
            if use_guard
            else None
        )
        self.answer_options = {"rel_tol": cfg.rel_tol, "abs_tol": cfg.abs_tol, "judge": judge}
        rewards_steps = "reasoning" in self.objectives.values()
        self.malformed = cfg.malformed or ("zero" if rewards_steps else "lenient")
        self.last_metrics: dict[str, float] = {}
        self._trl = TRLRewardFunctions(self)

    @classmethod
    def make_config(cls, params: Mapping[str, Any], where: str = "reward.params") -> RewardConfig:
        """This reward's typed config from its parameters (``reward.params`` of a run config):
        an unknown name or a bad value is a one-line error naming it."""
        names = [f.name for f in dataclasses.fields(cls.config_class)]
        unknown = sorted(set(params) - set(names))
        if unknown:
            near = difflib.get_close_matches(unknown[0], names, n=1)
            hint = f": did you mean {near[0]!r}?" if near else ""
            raise ConfigError(
                f"{where}: unknown key(s) {', '.join(map(repr, unknown))} for reward {cls.name!r} "
                f"(unknown parameter {unknown[0]!r}{hint}); allowed: {', '.join(sorted(names))}"
            )
        config = from_dict(cls.config_class, dict(params), where)
        if not config.negative_weights:
            for f in dataclasses.fields(config):
                value = getattr(config, f.name)
                if f.metadata.get("weight") and isinstance(value, (int, float)) and value < 0:
                    raise ConfigError(
                        f"{where}.{f.name}: invalid value {value!r}; a reward weight must be >= 0 (set "
                        f"{where}.negative_weights: true if the penalty is meant)"
                    )
        return config

    # -- to implement -----------------------------------------------------------------
    def components(self, batch: Batch) -> dict[str, torch.Tensor]:
        """Per-row component values for the *global* batch (NaN = not applicable)."""
        raise NotImplementedError

    # -- the one evaluation (rewards/batch.py) -------------------------------------
    def score(
        self, completions: Sequence[Any], rows: Sequence[Mapping[str, Any]], with_steps: bool | None = None
    ) -> Scored:
        """Parse, check answers and match steps for these rows; no guard, no state.

        ``completions``: model output (text, TRL's message lists, anything: it never
        raises) or already parsed :class:`ParsedOutput`. ``rows``: one mapping per
        completion with the data columns (``answer``, ``reference_steps``, optional
        ``reference_sets`` and ``choices``). Steps are scored when the reward or its step credit
        uses them (:attr:`scores_steps`), or when ``with_steps`` asks (validation reports Match F1
        for every reward). A reward computed for training (``with_steps`` None) scores at most
        :data:`MAX_SCORED_STEPS` steps a completion; a report (``with_steps=True``: validation,
        evaluation, the scorer CLI) scores every step it is given.
        """
        scorer = self._scorer() if (self.scores_steps if with_steps is None else with_steps) else None
        return evaluate(
            completions,
            rows,
            scorer=scorer,
            step_metric=self.step_metric,
            answer_options=self.answer_options,
            max_steps=MAX_SCORED_STEPS if with_steps is None else None,
        )

    def pin_references(self, rows: Any) -> int:
        """Embed every reference step of ``rows`` (a ``datasets.Dataset`` or a list of
        mappings) once, before training, when this reward scores steps
        (:meth:`MatchF1Scorer.pin`). Returns how many texts were encoded."""
        if not self.scores_steps:
            return 0
        names = getattr(rows, "column_names", None)
        column = (
            (lambda k: rows[k] if k in names else [None] * len(rows))
            if names is not None
            else (lambda k: [r.get(k) for r in rows])
        )
        chains = map(reference_chains, column("reference_steps"), column("reference_sets"))
        return self._scorer().pin(step for cs in chains for chain in cs or [] for step in chain)

    @property
    def scores_steps(self) -> bool:
        """Whether every evaluation matches the steps: the reward pays for them, or step credit is on."""
        return self.uses_steps or self.step_credit.on

    def _scorer(self) -> MatchF1Scorer:
        if self.scorer is None:  # a reward without step terms, asked for Match F1 (validation)
            self.scorer = shared_scorer(**self._scorer_settings)
        return self.scorer

    @classmethod
    def outcome_name(cls, config: RewardConfig) -> str | None:
        """:attr:`outcome_component` of this reward with ``config``: known before anything loads
        (``train/grpo.py --check`` refuses ``dynamic_sampling.metric: outcome`` without one)."""
        return cls.outcome_component

    def outcome(self, batch: Batch) -> torch.Tensor:
        """Each row's outcome: 1.0 where its answer is right as the accuracy component pays it (a
        malformed completion is wrong under ``malformed: zero``), else 0.0; before weight and guard."""
        return self.as_rewarded(batch).correct

    # -- the reward of a batch and its diagnostics (rewards/diagnostics.py) ---------------
    def rewards(self, batch: Batch, guard: bool = True) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
        """Components of a GLOBAL batch (all processes) and the docs/method.md section 6 diagnostics.

        With ``guard`` the verbosity guard judges the batch and then adds it to its window
        (call it once per generation batch); without, the components are the plain ones.
        """
        import torch

        comps = self.checked_components(batch)
        flagged = torch.zeros(len(batch), dtype=torch.bool)
        if guard and self.guard is not None:
            flagged = self.guard.step(batch.n_pred)
            comps = {k: self.guard.apply(v, flagged) for k, v in comps.items()}
        self.last_metrics = diagnostics(batch, comps, flagged)
        return comps, self.last_metrics

    def total(self, batch: Batch) -> torch.Tensor:
        """Each row's reward without the guard (the sum of its applicable components)."""
        return total(self.checked_components(batch), len(batch))

    def checked_components(self, batch: Batch) -> dict[str, torch.Tensor]:
        """:meth:`components` of the batch as the reward sees it (:meth:`as_rewarded`), each value
        usable (:func:`value_problem`): every reward, metric and report reads them through here."""
        comps = self.components(self.as_rewarded(batch))
        for name, values in comps.items():
            bad = values.isinf() | (values.abs() > MAX_REWARD)
            if bool(bad.any()):
                i = int(bad.nonzero()[0])
                raise RewardFunctionError(
                    f"reward {self.name or type(self).__name__!r}: component {name!r} is "
                    f"{value_problem(float(values[i]))} for completion {i} of the batch"
                )
        return comps

    def as_rewarded(self, batch: Batch) -> Batch:
        """The batch as the reward sees it: with ``malformed: zero`` a completion that fails the
        format check is neither correct nor has a step score (the metrics keep the lenient reading)."""
        return zero_malformed(batch) if self.malformed == "zero" else batch

    def per_row(self, batch: Batch) -> dict[str, torch.Tensor]:
        """Each completion's value of every metric this reward can report, by name: the metric
        table's ``reward`` and ``row`` rows (crystal_grpo/metrics.py) read them. The reward's
        components (without the guard) and extra fields come under their own names, so a metric
        row naming one is all a new metric takes; override this for a value of your own. The
        evaluation's own names win where a component has the same name."""
        comps = self.checked_components(batch)
        extra = {} if batch.extra is None else {n: batch.extra[:, i] for i, n in enumerate(self.extra_fields)}
        return {
            **extra,
            **comps,
            "accuracy": batch.correct,
            "format_rate": batch.format_ok,
            "steps_mean": batch.n_pred,
            **{f: getattr(batch, f) for f in ("precision", "recall", "f1", "lis_ratio", "ordered_f1")},
            "reward": total(comps, len(batch)),
        }

    def metrics(self, batch: Batch) -> dict[str, float]:
        """The metric table's ``reward`` rows for a batch, in table order: what validation and
        evaluation report (NaN for a row this reward has no value for, see :meth:`per_row`)."""
        values = self.per_row(batch)
        return {m: nanmean(values[m]) if m in values else math.nan for m in metric_names("reward")}

    # -- plain TRL (rewards/trl_functions.py) ---------------------------------------------
    def reward_funcs(self) -> list[Callable[..., list[float | None]]]:
        """One reward function per component, named after it, for a plain ``trl.GRPOTrainer``;
        TRL calls each on the same batch, which is evaluated once (:class:`TRLRewardFunctions`).
        ``CrystalGRPOTrainer`` does not call these: it evaluates once itself
        (``_calculate_rewards``) and uses them for the names only."""
        return self._trl.functions()

    # -- checkpoint state: the verbosity guard's window -----------------------------------
    def state_dict(self) -> dict:
        return {"guard": self.guard.state_dict() if self.guard else None}

    def load_state_dict(self, state: dict) -> None:
        if self.guard is not None and state.get("guard"):
            self.guard.load_state_dict(state["guard"])

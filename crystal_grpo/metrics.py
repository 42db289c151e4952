"""The metric table: every number that validation, evaluation, the sweep report, the training
plots and the run summary show, with its label, format and which way is better.

Reports look names up here, so a metric missing from the table fails at import or in the tests
(``tests/test_metrics.py``), never halfway through writing a report. Adding a metric is one row:
in :data:`TABLE`, or from your own code :func:`register`. A row's ``source`` says where its value
comes from: ``"reward"`` (a per-completion value of :meth:`RewardModule.per_row`, NaN where the
reward has none), ``"row"`` (kept by evaluation only), ``"evaluation"`` (over a row's samples,
pass@k) or ``"training"`` (the trainer's log, or a sweep diagnostic derived from it). No torch
here: configs, reports and the sweep read this table without loading a model stack.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from crystal_grpo.errors import CrystalError

Source = Literal["reward", "row", "evaluation", "training"]


@dataclass(frozen=True)
class MetricSpec:
    """One metric: ``label`` names it in prose and plots, ``header`` in wide tables."""

    name: str
    label: str
    source: Source
    higher_is_better: bool | None = True  # None: neither (a count, a slope)
    fmt: str = ".3f"
    header: str = ""  # default: the label
    title: str = ""  # a report's row title; default: the label, capitalised

    @property
    def column(self) -> str:
        return self.header or self.label

    @property
    def heading(self) -> str:
        return self.title or self.label[:1].upper() + self.label[1:]


TABLE: tuple[MetricSpec, ...] = (
    # Validation and evaluation (RewardModule.metrics), in report order.
    MetricSpec("accuracy", "accuracy", "reward"),
    MetricSpec("f1", "Match F1", "reward"),
    MetricSpec("precision", "precision", "reward"),
    MetricSpec("recall", "recall", "reward"),
    MetricSpec("ordered_f1", "Ordered F1", "reward"),
    MetricSpec("format_rate", "format rate", "reward", header="format"),
    MetricSpec("steps_mean", "mean steps", "reward", higher_is_better=None, header="steps"),
    MetricSpec("reward", "reward", "reward"),
    # Evaluation only.
    MetricSpec("lis_ratio", "LIS ratio", "row"),
    MetricSpec("pass_at_k", "pass@k", "evaluation", title="pass@k"),
    # Training logs and the sweep's diagnostics.
    MetricSpec("kl", "KL", "training", higher_is_better=False),
    MetricSpec("loss", "training loss", "training", higher_is_better=None),
    MetricSpec("discrimination_gap", "discrimination gap", "training", header="disc. gap"),
    MetricSpec("r_f1", "r(F1)", "training"),
    MetricSpec("kl_max", "KL max", "training", higher_is_better=False),
    MetricSpec("grad_norm_slope", "grad-norm slope", "training", higher_is_better=None, fmt="+.4f"),
    MetricSpec("nonfinite_skipped", "non-finite steps skipped", "training", higher_is_better=False, fmt=".0f"),
    MetricSpec("train_accuracy", "train acc.", "training"),
    MetricSpec("train_accuracy_slope", "train acc. slope", "training", fmt="+.4f"),
    MetricSpec("accuracy_varies", "groups acc. varies", "training"),
    MetricSpec("frac_easy", "easy rows", "training", higher_is_better=None),
)


class MetricTableError(CrystalError, ValueError):
    """A registered metric row that contradicts the table."""


def register(*specs: MetricSpec) -> None:
    """Add rows to the table (from outside this package). Registering a row again is a no-op,
    so a module may register at import however often it is imported; a name the table has with
    another spec is an error."""
    global TABLE
    known = {m.name: m for m in TABLE}
    for m in specs:
        if m.name in known and known[m.name] != m:
            raise MetricTableError(
                f"metric {m.name!r} is already in the metric table as {known[m.name]}; registering {m} would change it"
            )
        if m.name not in known:
            TABLE, known[m.name] = (*TABLE, m), m


class UnknownMetric(CrystalError, KeyError):
    def __str__(self) -> str:
        return (
            f"metric {self.args[0]!r} is not in the metric table (crystal_grpo/metrics.py); "
            f"known: {', '.join(m.name for m in TABLE)}"
        )


def spec(name: str) -> MetricSpec:
    """The row of ``name``; an error naming the table when there is none."""
    for m in TABLE:
        if m.name == name:
            return m
    raise UnknownMetric(name)


def names(*sources: Source) -> tuple[str, ...]:
    """The metrics of these sources, in table order."""
    return tuple(m.name for m in TABLE if m.source in sources)


def label(name: str) -> str:
    return spec(name).label


def better(name: str, new: float, old: float) -> bool:
    """Whether ``new`` beats ``old`` (a metric with no direction counts higher as better)."""
    return new < old if spec(name).higher_is_better is False else new > old


def per_completion() -> tuple[str, ...]:
    """What evaluation keeps for each completion: the ``reward`` rows, then the ``row`` rows."""
    return names("reward") + names("row")


#: What validation and evaluation report (``RewardModule.metrics``), in this order: the table's own
#: rows (``names("reward")`` has the registered ones too).
VALIDATION: tuple[str, ...] = names("reward")
#: A validation metric of the table's own rows (``validation.metric`` of a run config picks the best
#: checkpoint by one; a registered row is allowed there once the reward that registers it loads).
Metric = Literal[VALIDATION]  # type: ignore[valid-type]

"""Training curves of a run folder in one PNG: reward, Match F1, accuracy, format rate, KL, loss.

A multi-phase run is drawn on one step axis, the run's cumulative optimizer step: phase k's
steps are offset by the steps of the phases before it, so its step-0 validation sits on the
boundary with the previous phase's last one. Boundaries are vertical lines labelled with
the phase names. A series a phase did not log (KL in an SFT phase) is simply not drawn.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from crystal_grpo.metrics import label
from crystal_grpo.train.run.layout import CURVES
from crystal_grpo.train.run.summary import read_phases


@dataclass(frozen=True)
class Panel:
    """A panel: the metric it draws (its title is the metric table's label), the training-row
    key (or ``<reward>/`` suffix) and the validation key."""

    metric: str
    train_key: str | None
    val_key: str | None

    @property
    def title(self) -> str:
        return label(self.metric)


PANELS = (
    Panel("reward", "reward", "reward"),
    Panel("f1", "f1", "f1"),
    Panel("accuracy", "accuracy", "accuracy"),
    Panel("format_rate", "format_rate", "format_rate"),
    Panel("kl", "kl", None),
    Panel("loss", "loss", None),
)


@dataclass
class Curve:
    """One phase's points of one series, at cumulative steps."""

    phase: str
    kind: str  # "train" or "validation"
    steps: list[int]
    values: list[float]


@dataclass
class RunCurves:
    """Everything the figure draws, in numbers (tests check these, not pixels)."""

    title: str
    boundaries: list[tuple[int, int, str]]  # (first, last cumulative step, phase name); [] for one phase
    panels: dict[str, list[Curve]] = field(default_factory=dict)


def _series(rows: list[dict], suffix: str) -> tuple[list[int], list[float]]:
    """(steps, values) of the first key equal to or ending with ``suffix``."""
    xs, ys = [], []
    for r in rows:
        key = next((k for k in r if k == suffix or k.endswith("/" + suffix)), None)
        if key is not None and isinstance(r[key], (int, float)):
            xs.append(r["step"])
            ys.append(r[key])
    return xs, ys


def phase_series(run_dir: str | Path) -> RunCurves:
    """Each panel's curves (training, then validation; phase by phase), shifted to the run's
    cumulative step; series a phase did not log are left out."""
    run_dir = Path(run_dir)
    phases = read_phases(run_dir)
    multi = phases[0].folder != run_dir  # phase folders (even a first one alone, still running)
    if not any(p.train or p.validation for p in phases):
        where = f" in any of its phase folders ({', '.join(p.folder.name for p in phases)})" if multi else ""
        raise FileNotFoundError(
            f"{run_dir}: nothing to plot: no training rows in metrics.jsonl and no "
            f"validation.jsonl{where} (a run writes them from its first logged step)"
        )
    curves = RunCurves(run_dir.name, [(p.offset, p.offset + p.steps, p.name) for p in phases] if multi else [])
    for panel in PANELS:
        curves.panels[panel.title] = []
        for kind, key in (("train", panel.train_key), ("validation", panel.val_key)):
            for p in phases:
                xs, ys = _series(p.train if kind == "train" else p.validation, key) if key else ([], [])
                if xs:
                    curves.panels[panel.title].append(Curve(p.name, kind, [p.offset + x for x in xs], ys))
    return curves


def plot_run(run_dir: str | Path, out: str | Path | None = None) -> Path:
    """Draw a run folder (one phase or many); writes ``training_curves.png`` in it by default."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    run_dir = Path(run_dir)
    curves = phase_series(run_dir)
    fig, axes = plt.subplots(3, 2, figsize=(11, 10))
    style = {"train": dict(color="C0", lw=1.2), "validation": dict(color="C1", lw=1.2, marker="o", ms=4)}
    for ax, panel in zip(axes.flat, PANELS):
        labelled = set()
        for c in curves.panels[panel.title]:
            ax.plot(c.steps, c.values, label=None if c.kind in labelled else c.kind, **style[c.kind])
            labelled.add(c.kind)
        for first, last, name in curves.boundaries:
            if first:
                ax.axvline(first, color="0.4", ls="--", lw=0.9)
            ax.text(
                (first + last) / 2,
                1.0,
                name,
                transform=ax.get_xaxis_transform(),
                ha="center",
                va="bottom",
                fontsize=8,
                color="0.3",
            )
        if not labelled:
            ax.text(0.5, 0.5, "not logged", transform=ax.transAxes, ha="center", va="center", color="0.5")
        else:
            ax.legend(fontsize=8)
        if curves.boundaries:
            total = curves.boundaries[-1][1]
            ax.set_xlim(-0.02 * total, 1.02 * total or 1)
        ax.set_title(panel.title, pad=14 if curves.boundaries else 6)
        ax.set_xlabel("optimizer step (cumulative over phases)" if curves.boundaries else "step")
        ax.grid(alpha=0.3)
    fig.suptitle(curves.title)
    fig.tight_layout()
    out = Path(out) if out else run_dir / CURVES
    fig.savefig(out, dpi=90)
    plt.close(fig)
    return out

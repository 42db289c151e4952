"""The report of a sweep: one row a point (mean and spread over seeds), a CSV, a JSON and plots.

Everything is read from the points' own run folders (train/run/summary.py's reader), so a report
can be made at any time from whatever has finished: the best checkpoint's validation metrics,
the reward-weight diagnostics the trainer logs, the grad-norm trend and whether a run diverged,
and with ``eval.data`` the evaluation scores of the final weights (the primary result), every
arm against the first, paired by row, with intervals that resample seeds and rows
(crystal_grpo/stats.py). The columns: docs/experiments.md.
"""

from __future__ import annotations

import csv
import io
import json
import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from crystal_grpo.jsonl import atomic_write_text, read_json
from crystal_grpo.metrics import label, per_completion, spec
from crystal_grpo.rewards.base import METRICS
from crystal_grpo.train.run.layout import FINAL, PHASE_DONE, is_finished, read_best, run_targets, step_of
from crystal_grpo.train.run.summary import Phase, read_phases, slope

if TYPE_CHECKING:
    from crystal_grpo.train.tools.sweep import Sweep

STATUS_FILE = "sweep_status.json"  # the sweep folder's record of each point's runs (train/tools/sweep.py writes it)


def read_status(sweep: Sweep) -> dict[str, dict]:
    return read_json(sweep.output_dir / STATUS_FILE) or {}


def eval_targets(folder: Path) -> dict[str, Path]:
    """What a point's evaluation scores: ``eval`` the last phase's final weights (the primary
    result: every arm trained its whole budget), ``eval_best`` its best checkpoint by
    validation (secondary; absent when that is the final step)."""
    try:
        best = run_targets(folder)[-1][1]
    except (OSError, ValueError, KeyError):
        return {}
    final = best.parent / FINAL
    targets = {"eval": final} if final.is_dir() else {}
    last = (read_json(best.parent / PHASE_DONE) or {}).get("global_step")  # (its checkpoint may be rotated away)
    if step_of(best) not in (None, last):
        targets["eval_best"] = best
    return targets


#: The validation metrics of the table (the best checkpoint's), in METRICS order; the same ones
#: are read from each evaluation's report.
BEST = EVAL = tuple(m for m in METRICS if m != "reward")
DIAGNOSTICS = (
    "discrimination_gap",
    "r_f1",
    "kl_max",
    "grad_norm_slope",
    "nonfinite_skipped",
    "train_accuracy",
    "train_accuracy_slope",
    "accuracy_varies",
    "frac_easy",
)
#: The Markdown table's columns (non-finite skips show in its "diverged" column).
COLUMNS = (*BEST, *(d for d in DIAGNOSTICS if d != "nonfinite_skipped"))
COLLAPSE_SHARE = 0.5  # format rate below this share of its best so far = collapsed


def _finite(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _train_values(phase: Phase, suffix: str) -> list[tuple[int, float]]:
    """(step, value) of the training key ``suffix`` (or ``<reward>/<suffix>``)."""
    out = []
    for r in phase.train:
        key = next((k for k in r if k == suffix or k.endswith("/" + suffix)), None)
        if key is not None and _finite(r[key]):
            out.append((r["step"], float(r[key])))
    return out


def collapse_step(validation: list[dict]) -> int | None:
    """First validated step whose format rate fell below half of the best before it."""
    best = None
    for r in validation:
        f = r.get("format_rate")
        if not _finite(f):
            continue
        if best is not None and best >= 0.5 and f < COLLAPSE_SHARE * best:
            return int(r["step"])
        best = f if best is None else max(best, f)
    return None


def point_metrics(folder: Path) -> dict[str, Any]:
    """One finished run's numbers (its last phase: the one the sweep varies)."""
    phase = read_phases(folder)[-1]
    best = read_best(phase.folder)
    val = best.metrics if best else (phase.validation[-1] if phase.validation else {})
    out: dict[str, Any] = {"best_step": best.step if best else (val.get("step") if val else None)}
    out.update({m: val.get(m) for m in BEST})
    mean = lambda xs: sum(xs) / len(xs) if xs else None
    out["discrimination_gap"] = mean([v for _, v in _train_values(phase, "discrimination_gap")])
    out["r_f1"] = mean([v for _, v in _train_values(phase, "r_f1")])
    kl = [v for _, v in _train_values(phase, "kl_max")]
    out["kl_max"] = max(kl) if kl else None
    grad = _train_values(phase, "grad_norm")
    out["grad_norm_slope"] = slope([s for s, _ in grad], [v for _, v in grad]) if grad else None
    acc = _train_values(phase, "accuracy")  # of the sampled completions, each step
    out["train_accuracy"] = mean([v for _, v in acc])
    out["train_accuracy_slope"] = slope([s for s, _ in acc], [v for _, v in acc]) if len(acc) > 1 else None
    out["accuracy_varies"] = mean([v for _, v in _train_values(phase, "accuracy_varies")])
    easy = [v for ph in read_phases(folder) for _, v in _train_values(ph, "frac_easy")]  # every GRPO phase
    out["frac_easy"] = mean(easy)
    skipped = [v for _, v in _train_values(phase, "nonfinite_skipped_total")]
    out["nonfinite_skipped"] = max(skipped) if skipped else 0.0
    out["format_collapse_step"] = collapse_step(phase.validation)
    best_is_final = "eval_best" not in eval_targets(folder)
    for name in ("eval", "eval_best"):  # the final weights; the best checkpoint (the same when it is the final step)
        report = read_json(folder / ("eval" if name == "eval_best" and best_is_final else name) / "report.json")
        if report:  # not evaluated yet: left out, never stood in for by another checkpoint
            out.update({f"{name}_{m}": (report["overall"].get(m) or {}).get("value") for m in EVAL})
    return out


def divergence(m: dict[str, Any]) -> str:
    parts = []
    if m.get("nonfinite_skipped"):
        parts.append(f"{m['nonfinite_skipped']:.0f} non-finite updates skipped")
    if m.get("format_collapse_step") is not None:
        parts.append(f"format collapsed at step {m['format_collapse_step']}")
    return "; ".join(parts) or "no"


def _spread(values: list[float]) -> tuple[float | None, float | None]:
    """Mean and sample standard deviation (None with fewer than two values)."""
    xs = [v for v in values if _finite(v)]
    if not xs:
        return None, None
    mu = sum(xs) / len(xs)
    sd = math.sqrt(sum((x - mu) ** 2 for x in xs) / (len(xs) - 1)) if len(xs) > 1 else None
    return mu, sd


PAIRED = ("accuracy", "f1", "ordered_f1", "format_rate", "steps_mean")


def paired_on_eval(sweep: Sweep, arms: list[str], bootstrap: int = 1000, seed: int = 0) -> dict[str, Any] | None:
    """Every arm against the first on the evaluation rows, paired by row: the difference of the
    means with a 95% interval that resamples each arm's seeds, then rows (crystal_grpo/stats.py), a
    Welch test on the per-seed means, and the seeds a difference of that size would need."""
    from crystal_grpo.stats import seed_test, two_level_ci
    from crystal_grpo.train.tools.eval_report import load_scored

    per_arm = {}
    for arm in arms:
        runs = [
            load_scored(sweep.output_dir / p.name / "eval")
            for p in sweep.points
            if p.arm == arm and (sweep.output_dir / p.name / "eval" / "report.json").is_file()
        ]
        if runs:
            per_arm[arm] = runs
    if len(per_arm) < 2 or arms[0] not in per_arm:
        return None
    common = sorted(set.intersection(*(set(r) for runs in per_arm.values() for r in runs)))
    cols = [per_completion().index(m) for m in PAIRED]
    table = {arm: np.array([[r[i][cols] for i in common] for r in runs]) for arm, runs in per_arm.items()}
    base = table[arms[0]]  # [seeds, rows, metrics]
    out = {"baseline": arms[0], "rows": len(common), "arms": {}}
    for arm, values in table.items():
        lo, hi = two_level_ci(base, values, bootstrap, seed)
        out["arms"][arm] = {}
        for k, m in enumerate(PAIRED):
            mine, theirs = np.nanmean(values[:, :, k], axis=1), np.nanmean(base[:, :, k], axis=1)
            test = seed_test(theirs, mine)
            out["arms"][arm][m] = {
                "mean": float(np.nanmean(mine)),
                "diff": float(np.nanmean(mine) - np.nanmean(theirs)),
                "ci_low": float(lo[k]),
                "ci_high": float(hi[k]),
                "seeds": len(mine),
                "p_seeds": test.p,
                "seeds_needed": test.seeds_needed,
            }
    return out


def build(sweep: Sweep) -> dict[str, Any]:
    """Per point: status and numbers; per arm: mean/std over its finished seeds."""
    status = read_status(sweep)
    points, arms = [], {}
    for p in sweep.points:
        folder = sweep.output_dir / p.name
        entry: dict[str, Any] = {"point": p.name, "arm": p.arm, "seed": p.seed, "overrides": p.overrides}
        if is_finished(folder):
            entry["status"] = "done"
            entry["metrics"] = point_metrics(folder)
        elif status.get(p.name, {}).get("status") == "failed":
            entry.update({k: status[p.name].get(k) for k in ("returncode", "log_tail")}, status="failed")
        else:
            entry["status"] = "running or interrupted" if folder.is_dir() else "not started"
        points.append(entry)
        arms.setdefault(
            p.arm,
            {"arm": p.arm, "overrides": {k: v for k, v in p.overrides.items() if k != "training.seed"}, "runs": []},
        )
        if entry["status"] == "done":
            arms[p.arm]["runs"].append(entry["metrics"])
    keys = (*BEST, *DIAGNOSTICS, *(f"{e}_{m}" for e in ("eval", "eval_best") for m in EVAL))
    for arm in arms.values():
        runs = arm.pop("runs")
        arm["seeds_done"] = len(runs)
        arm["mean"], arm["std"] = {}, {}
        for k in keys:
            arm["mean"][k], arm["std"][k] = _spread([r.get(k) for r in runs])
        arm["diverged"] = "; ".join(sorted({divergence(r) for r in runs} - {"no"})) or ("no" if runs else "-")
    return {
        "sweep": sweep.name,
        "folder": str(sweep.output_dir),
        "points": points,
        "arms": list(arms.values()),
        "paired_eval": paired_on_eval(sweep, list(arms)) if sweep.eval else None,
    }


# --------------------------------------------------------------------------------- output


def _cell(mu: float | None, sd: float | None, fmt: str = ".3f") -> str:
    if mu is None:
        return "-"
    return format(mu, fmt) + (f" ± {format(sd, fmt)}" if sd is not None else "")


def _eval_label(key: str) -> str:
    """``eval_f1`` -> "eval Match F1 (final)", ``eval_best_f1`` -> "eval Match F1 (best)"."""
    which, metric = ("best", key[10:]) if key.startswith("eval_best_") else ("final", key[5:])
    return f"eval {spec(metric).column} ({which})"


def markdown(report: dict[str, Any]) -> str:
    cols = COLUMNS
    evals = [
        f"{e}_{m}"
        for e in ("eval", "eval_best")
        for m in ("accuracy", "f1")
        if any(a["mean"].get(f"{e}_{m}") is not None for a in report["arms"])
    ]
    head = ["arm", "seeds", *(spec(k).column for k in cols), *(_eval_label(k) for k in evals), "diverged"]
    lines = [
        f"# Sweep {report['sweep']}",
        "",
        "Best-checkpoint validation metrics and training diagnostics, mean ± sample std over seeds; on the "
        "evaluation data the final weights (every arm's whole budget: the primary result) and the best "
        "checkpoint by validation.",
        "",
        "| " + " | ".join(head) + " |",
        "|" + "---|" * len(head),
    ]
    for a in report["arms"]:
        cells = [
            a["arm"],
            str(a["seeds_done"]),
            *(_cell(a["mean"][k], a["std"][k], spec(k).fmt) for k in cols),
            *(_cell(a["mean"][k], a["std"][k]) for k in evals),
            a["diverged"],
        ]
        lines.append("| " + " | ".join(cells) + " |")
    paired = report.get("paired_eval")
    if paired:
        lines += [
            "",
            f"## On the evaluation data (final weights): each arm against {paired['baseline']}",
            "",
            f"Paired over {paired['rows']} rows. 95% intervals of the difference resample each arm's "
            "seeds, then rows (two-level bootstrap), so seed-to-seed variance is in them; p is Welch's test "
            "on the per-seed means, n the seeds per arm a difference of that size would need (80% power).",
            "",
            "| arm | " + " | ".join(f"{spec(m).column} (diff [95% CI], p, n)" for m in PAIRED) + " |",
            "|---|" + "---|" * len(PAIRED),
        ]
        for arm, ms in paired["arms"].items():
            cells = [
                f"{v['mean']:.3f} ({v['diff']:+.3f} [{v['ci_low']:+.3f}, {v['ci_high']:+.3f}]"
                + (f", p={v['p_seeds']:.2f}, n={v['seeds_needed'] or '-'})" if v.get("p_seeds") is not None else ")")
                for v in ms.values()
            ]
            lines.append(f"| {arm} | " + " | ".join(cells) + " |")
    bad = [p for p in report["points"] if p["status"] != "done"]
    if bad:
        lines += ["", "## Points not finished", ""]
        for p in bad:
            lines.append(
                f"- {p['point']}: {p['status']}"
                + (f" (exit code {p.get('returncode')})" if p["status"] == "failed" else "")
            )
            if p.get("log_tail"):
                lines += ["", "```", p["log_tail"], "```", ""]
    return "\n".join(lines) + "\n"


def to_csv(report: dict[str, Any]) -> str:
    keys = (*BEST, *DIAGNOSTICS, *(f"{e}_{m}" for e in ("eval", "eval_best") for m in EVAL))
    buf = io.StringIO()
    w = csv.writer(buf)
    w.writerow(["arm", "seeds_done", *(f"{k}_{s}" for k in keys for s in ("mean", "std")), "diverged"])
    for a in report["arms"]:
        w.writerow(
            [
                a["arm"],
                a["seeds_done"],
                *(a[s][k] if a[s][k] is not None else "" for k in keys for s in ("mean", "std")),
                a["diverged"],
            ]
        )
    return buf.getvalue()


#: Curves overlaid in report.png: (title, validation key or None, training key or None).
CURVES = (
    (f"validation {label('f1')}", "f1", None),
    (f"validation {label('accuracy')}", "accuracy", None),
    (f"training {label('reward')}", None, "reward"),
    (label("kl"), None, "kl"),
)


def plot(sweep: Sweep, report: dict[str, Any]) -> list[Path]:
    """``report.png``: each finished point's last-phase curves, one colour an arm; for a weight
    sweep (``x``) also ``report_weights.png``: the arms' metrics against the swept weight."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = []
    arms = [a["arm"] for a in report["arms"]]
    colors = {arm: plt.get_cmap("tab10")(i % 10) for i, arm in enumerate(arms)}
    fig, axes = plt.subplots(1, len(CURVES), figsize=(4.2 * len(CURVES), 3.4))
    labelled = set()
    for p in report["points"]:
        if p["status"] != "done":
            continue
        phase = read_phases(sweep.output_dir / p["point"])[-1]
        label = p["arm"] if p["arm"] not in labelled else None
        labelled.add(p["arm"])
        for ax, (_title, vkey, tkey) in zip(axes, CURVES):
            rows = (
                [(r["step"], r[vkey]) for r in phase.validation if _finite(r.get(vkey))]
                if vkey
                else _train_values(phase, tkey)
            )
            if rows:
                ax.plot(
                    *zip(*rows),
                    color=colors[p["arm"]],
                    marker="o" if vkey else None,
                    ms=3,
                    lw=1.2,
                    alpha=0.85,
                    label=label,
                )
    for ax, (title, *_rest) in zip(axes, CURVES):
        ax.set_title(title)
        ax.set_xlabel("step (last phase)")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.suptitle(f"sweep {report['sweep']}: one line a run, one colour an arm")
    fig.tight_layout()
    path = sweep.output_dir / "report.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    out.append(path)
    if sweep.x:
        xs = [(a["overrides"].get(sweep.x), a) for a in report["arms"]]
        xs = sorted(((x, a) for x, a in xs if _finite(x)), key=lambda t: t[0])
        if xs:
            keys = ("accuracy", "f1", "discrimination_gap", "r_f1", "kl_max", "grad_norm_slope")
            fig, axes = plt.subplots(1, len(keys), figsize=(3.3 * len(keys), 3.2))
            for ax, k in zip(axes, keys):
                pts = [(x, a["mean"][k], a["std"][k] or 0.0) for x, a in xs if a["mean"][k] is not None]
                if pts:
                    ax.errorbar(
                        [p[0] for p in pts], [p[1] for p in pts], yerr=[p[2] for p in pts], marker="o", capsize=3
                    )
                ax.set_title(spec(k).column)
                ax.set_xlabel(sweep.x.rsplit(".", 1)[-1])
                ax.grid(alpha=0.3)
            fig.tight_layout()
            path = sweep.output_dir / "report_weights.png"
            fig.savefig(path, dpi=110)
            plt.close(fig)
            out.append(path)
    return out


def write_report(sweep: Sweep) -> tuple[str, list[Path]]:
    """``report.md``, ``report.csv``, ``report.json`` and the plots in the sweep folder; returns
    the Markdown and the plots."""
    sweep.output_dir.mkdir(parents=True, exist_ok=True)
    report = build(sweep)
    text = markdown(report)
    atomic_write_text(sweep.output_dir / "report.json", json.dumps(report, indent=2, default=str))
    atomic_write_text(sweep.output_dir / "report.csv", to_csv(report))
    atomic_write_text(sweep.output_dir / "report.md", text)
    plots = plot(sweep, report) if any(p["status"] == "done" for p in report["points"]) else []
    return text, plots

"""What an evaluation reports: overall metrics with bootstrap intervals, breakdowns, a table
a person can paste into a paper, a plot, and paired comparisons of several evaluations.

Every figure is a macro average over data rows (docs/method.md section 3: dataset Match F1 is the
mean of per-example F1); with several samples a row first averages its samples, and the
bootstrap resamples rows, so the interval reflects the data, not the sampling.
"""

from __future__ import annotations

import json
import math
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from crystal_grpo.curricula.complexity import complexity_tier, step_count
from crystal_grpo.jsonl import atomic_write_text
from crystal_grpo.metrics import per_completion as row_metrics
from crystal_grpo.metrics import spec
from crystal_grpo.stats import bootstrap_ci, seed_test, two_level_ci
from crystal_grpo.stats import nanmean as _nanmean

#: Reference-step-count buckets (CRYSTAL's references have 3-42 steps, mean 11.6).
STEP_BUCKETS = ((1, 2), (3, 5), (6, 10), (11, 20), (21, None))


def step_bucket(n: int) -> str:
    for lo, hi in STEP_BUCKETS:
        if n >= lo and (hi is None or n <= hi):
            return f"{lo}+" if hi is None else (f"{lo}-{hi}" if hi != lo else str(lo))
    return "0"


def per_row_values(rows: Sequence[dict], scored: Sequence[dict]) -> tuple[list[str], np.ndarray, np.ndarray]:
    """Row ids, ``[rows, metrics]`` means over each row's samples (NaN where undefined, e.g.
    step metrics of a row without references), and pass@k (1 if any sample is correct). The
    metrics are :func:`row_metrics` (the table's validation rows, and those only evaluation
    keeps, e.g. the LIS ratio), in its order."""
    by_id: dict[str, list[dict]] = defaultdict(list)
    for s in scored:
        by_id[s["id"]].append(s)
    ids = [r["id"] for r in rows]
    metrics = row_metrics()
    values = np.full((len(ids), len(metrics)), np.nan)
    passed = np.zeros(len(ids))
    for n, rid in enumerate(ids):
        samples = by_id.get(rid, [])
        for m, name in enumerate(metrics):
            xs = [s[name] for s in samples if s.get(name) is not None]
            if xs:
                values[n, m] = float(np.mean(xs))
        passed[n] = float(any((s.get("accuracy") or 0) > 0 for s in samples))
    return ids, values, passed


def _finite(x) -> float | None:
    x = float(x)
    return x if math.isfinite(x) else None


def build_report(
    rows: Sequence[dict], scored: Sequence[dict], identity: dict, bootstrap: int = 1000, seed: int = 0
) -> dict:
    """Overall figures with 95% intervals, and breakdowns by source, complexity tier,
    reference step count (and the data's ``difficulty`` label when it has one)."""
    ids, values, passed = per_row_values(rows, scored)
    k = max((s["sample"] for s in scored), default=0) + 1
    table = np.column_stack([values, passed]) if k > 1 else values
    names = list(row_metrics()) + (["pass_at_k"] if k > 1 else [])
    lo, hi = bootstrap_ci(table, bootstrap, seed)
    mean = _nanmean(table)
    overall = {
        m: {"value": _finite(mean[i]), "ci_low": _finite(lo[i]), "ci_high": _finite(hi[i])}
        for i, m in enumerate(names)
    }
    groups = {
        "source": [r.get("source") or "-" for r in rows],
        "complexity tier": [complexity_tier(r) for r in rows],
        "reference steps": [step_bucket(step_count(r)) for r in rows],
    }
    if any(r.get("difficulty") for r in rows):
        groups["difficulty"] = [r.get("difficulty") or "-" for r in rows]
    breakdowns = {}
    for name, labels in groups.items():
        out = {}
        for label in sorted(set(labels), key=_label_order):
            sel = np.array([lab == label for lab in labels])
            out[label] = {"n": int(sel.sum()), **{m: _finite(v) for m, v in zip(names, _nanmean(table[sel]))}}
        breakdowns[name] = out
    return {
        **identity,
        "rows": len(ids),
        "samples_per_row": k,
        "bootstrap_resamples": bootstrap,
        "overall": overall,
        "breakdowns": breakdowns,
    }


def _label_order(label: str):
    tiers = {"easy": 0, "medium": 1, "hard": 2}
    head = label.split("-")[0].rstrip("+")
    return (0, tiers[label], "") if label in tiers else (1, int(head), "") if head.isdigit() else (2, 0, label)


def _fmt(x: float | None, digits: int = 3) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def markdown(report: dict) -> str:
    """The report as Markdown tables."""
    what = report.get("model") or report.get("predictions")
    lines = [
        f"# Evaluation of `{what}`",
        "",
        f"Data: `{report['data']}`, {report['rows']} rows, {report['samples_per_row']} sample(s) a row "
        f"(temperature {report['sampling']['temperature']}); reward `{report['reward']}`. "
        f"95% bootstrap intervals over rows ({report['bootstrap_resamples']} resamples).",
        "",
        "| metric | value | 95% CI |",
        "|---|---|---|",
    ]
    for m, v in report["overall"].items():
        lines.append(f"| {spec(m).heading} | {_fmt(v['value'])} | [{_fmt(v['ci_low'])}, {_fmt(v['ci_high'])}] |")
    cols = ("accuracy", "f1", "ordered_f1", "format_rate", "steps_mean")
    for name, groups in report["breakdowns"].items():
        lines += [
            "",
            f"## By {name}",
            "",
            f"| {name} | n | " + " | ".join(spec(c).heading for c in cols) + " |",
            "|---|---|" + "---|" * len(cols),
        ]
        for label, g in groups.items():
            lines.append(f"| {label} | {g['n']} | " + " | ".join(_fmt(g.get(c)) for c in cols) + " |")
    return "\n".join(lines) + "\n"


def plot(report: dict, path: Path) -> Path:
    """Accuracy, Match F1, Ordered F1 and format rate per complexity tier and per step bucket."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cols = ("accuracy", "f1", "ordered_f1", "format_rate")
    panels = [n for n in ("complexity tier", "reference steps", "difficulty") if n in report["breakdowns"]]
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 3.6), squeeze=False)
    for ax, name in zip(axes[0], panels):
        groups = report["breakdowns"][name]
        x = np.arange(len(groups))
        width = 0.8 / len(cols)
        for j, c in enumerate(cols):
            ax.bar(x + j * width, [g.get(c) or 0 for g in groups.values()], width, label=spec(c).heading)
        ax.set_xticks(x + 0.4 - width / 2, [f"{label}\n(n={g['n']})" for label, g in groups.items()])
        ax.set_ylim(0, 1)
        ax.set_title(f"by {name}")
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def write_report(out: Path, report: dict) -> None:
    atomic_write_text(out / "report.json", json.dumps(report, indent=2))
    atomic_write_text(out / "report.md", markdown(report))
    plot(report, out / "report.png")


# ------------------------------------------------------------------------------ comparing
def load_scored(folder: Path) -> dict[str, np.ndarray]:
    """Per-row metric means (:func:`per_row_values`) of a finished evaluation folder, by row id."""
    if not (folder / "report.json").exists():
        raise ValueError(f"{folder}: not a finished evaluation (no report.json)")
    with open(folder / "predictions.jsonl", encoding="utf-8") as fh:
        scored = [json.loads(line) for line in fh]
    ids, values, _ = per_row_values([{"id": i} for i in dict.fromkeys(s["id"] for s in scored)], scored)
    return dict(zip(ids, values))


def compare(arms: Sequence[Path | Sequence[Path]], bootstrap: int = 1000, seed: int = 0) -> dict:
    """Each arm's means on the rows every evaluation scored, and each arm's paired difference
    from the first. An arm is one evaluation folder or several (one per training seed): the
    interval then resamples seeds, then rows (:func:`two_level_ci`), and a per-seed Welch test
    and the seeds a difference of that size would need are reported beside it."""
    groups = [[Path(arm)] if isinstance(arm, (str, Path)) else [Path(f) for f in arm] for arm in arms]
    runs = [[load_scored(f) for f in g] for g in groups]
    common = sorted(set.intersection(*(set(r) for g in runs for r in g)))
    if not common:
        raise ValueError("the evaluations share no rows: compare evaluations of the same data")
    arr = [np.array([[r[i] for i in common] for r in g]) for g in runs]  # per arm: [seeds, rows, metrics]
    out = {
        "rows": len(common),
        "folders": [",".join(map(str, g)) for g in groups],
        "seeds": [len(g) for g in groups],
        "metrics": {},
    }
    lows, highs = zip(*[two_level_ci(arr[0], a, bootstrap, seed) for a in arr[1:]]) if len(arr) > 1 else ((), ())
    for m, name in enumerate(row_metrics()):
        entry = {"means": [_finite(_nanmean(_nanmean(a[:, :, m], axis=1))) for a in arr], "diffs": []}
        for j in range(1, len(arr)):
            per_seed = [_nanmean(a[:, :, m], axis=1) for a in (arr[0], arr[j])]
            test = seed_test(*per_seed)
            entry["diffs"].append(
                {
                    "value": _finite(entry["means"][j] - entry["means"][0])
                    if None not in (entry["means"][j], entry["means"][0])
                    else None,
                    "ci_low": _finite(lows[j - 1][m]),
                    "ci_high": _finite(highs[j - 1][m]),
                    "p_seeds": test.p,
                    "seeds_needed": test.seeds_needed,
                }
            )
        out["metrics"][name] = entry
    return out


def compare_markdown(result: dict) -> str:
    names = [Path(f.split(",")[0]).name or f for f in result["folders"]]
    names = [f"{n} ({k} seeds)" if k > 1 else n for n, k in zip(names, result.get("seeds", [1] * len(names)))]
    head = "| metric | " + " | ".join(names) + " | " + " | ".join(f"{n} - {names[0]} [95% CI]" for n in names[1:])
    seeded = max(result.get("seeds", [1])) > 1
    what = (
        (
            "seeds resampled, then rows (two-level bootstrap); p: Welch's test on the per-seed means; n: seeds "
            "per arm a difference of that size needs (80% power)"
        )
        if seeded
        else "rows resampled"
    )
    lines = [
        f"Paired over the {result['rows']} rows all evaluations scored; 95% intervals: {what}.",
        "",
        head + " |",
        "|---|" + "---|" * (2 * len(names) - 1),
    ]
    for m, e in result["metrics"].items():
        diffs = [
            f"{_fmt(d['value'], 3)} [{_fmt(d['ci_low'])}, {_fmt(d['ci_high'])}]"
            + (
                f" p={_fmt(d['p_seeds'], 2)} n={d['seeds_needed'] or '-'}"
                if seeded and d["p_seeds"] is not None
                else ""
            )
            for d in e["diffs"]
        ]
        lines.append(
            f"| {spec(m).heading} | " + " | ".join(_fmt(v) for v in e["means"]) + " | " + " | ".join(diffs) + " |"
        )
    return "\n".join(lines) + "\n"

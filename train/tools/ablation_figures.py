"""The figures and the control comparison of a reward ablation (the paper's Table 4 in miniature,
configs/sweeps/organism_ablation.yaml), read from a finished sweep's run folders: ``collapse.png``,
``pcgrad.png``, ``curriculum.png``, ``variants.png``, ``vs_control.md``, ``diagnosis.md`` and
``training.md``. What each holds: docs/experiments.md, "Over training".
"""

from __future__ import annotations

import json
import math
from collections import defaultdict
from pathlib import Path
from typing import Any

from crystal_grpo.jsonl import atomic_write_text, read_jsonl
from crystal_grpo.paths import user_path
from crystal_grpo.train.run.layout import samples_file
from crystal_grpo.train.run.summary import read_phases
from crystal_grpo.train.tools.sweep import Sweep, load_sweep
from crystal_grpo.train.tools.sweep_report import paired_on_eval, write_report

COLLAPSE_ARMS = ("answer_only", "shuffled_control", "cpr", "cpr_no_pcgrad", "cpr_curriculum")
CURRICULUM_PAIR = ("cpr", "cpr_curriculum")
CONTROL = "shuffled_control"


def _done(sweep: Sweep) -> dict[str, list[Path]]:
    """Arm -> the run folders of its finished seeds."""
    out: dict[str, list[Path]] = defaultdict(list)
    for p in sweep.points:
        folder = sweep.output_dir / p.name
        if (folder / "summary.json").is_file():
            out[p.arm].append(folder)
    return out


def train_curve(run: Path, suffix: str) -> dict[int, float]:
    """Global step -> the training log's ``suffix`` (``<reward>/<suffix>`` or ``suffix``)."""
    out = {}
    for phase in read_phases(run):
        for r in phase.train:
            key = next((k for k in r if k == suffix or k.endswith("/" + suffix)), None)
            if key is not None and isinstance(r[key], (int, float)) and math.isfinite(r[key]):
                out[phase.offset + r["step"]] = float(r[key])
    return out


def mean_curve(curves: list[dict[int, float]], window: int = 1) -> tuple[list[int], list[float]]:
    """The steps every curve has, and the mean over curves (a trailing moving average of ``window``)."""
    steps = sorted(set.intersection(*(set(c) for c in curves))) if curves else []
    means = [sum(c[s] for c in curves) / len(curves) for s in steps]
    smooth = [
        sum(means[max(0, i - window + 1) : i + 1]) / len(means[max(0, i - window + 1) : i + 1])
        for i in range(len(means))
    ]
    return steps, smooth


def accuracy_by_k(run: Path) -> dict[int, dict[str, float]]:
    """Global validation step -> difficulty -> sampled accuracy, from validation's per-row records."""
    out: dict[int, dict[str, float]] = {}
    for phase in read_phases(run):
        for v in phase.validation:
            path = phase.folder / samples_file(v["step"])
            by: dict[str, list[float]] = defaultdict(list)
            for row in read_jsonl(path):
                if row.get("difficulty") is not None:
                    by[str(row["difficulty"])].append(row["correct"])
            if by:  # (a later phase's step 0 is its start: the step before it keeps the one measured there)
                out.setdefault(phase.offset + v["step"], {k: sum(xs) / len(xs) for k, xs in by.items()})
    return out


def _pcgrad_runs(done: dict[str, list[Path]]) -> dict[str, list[Path]]:
    return {arm: runs for arm, runs in done.items() if any(train_curve(r, "pcgrad/cosine") for r in runs)}


def figures(sweep: Sweep) -> list[Path]:
    """Draw the three figures into the sweep folder; returns their paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    done, out = _done(sweep), []
    colors = {arm: plt.get_cmap("tab10")(i % 10) for i, arm in enumerate(done)}

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    for ax, (key, title) in zip(axes, (("steps_mean", "steps written"), ("f1", "step Match F1"))):
        for arm in COLLAPSE_ARMS:
            curves = [c for c in (train_curve(r, key) for r in done.get(arm, [])) if c]
            if curves:
                ax.plot(*mean_curve(curves, window=5), color=colors[arm], label=f"{arm} ({len(curves)})")
        ax.set_title(f"training: {title} (mean over seeds, 5-step average)")
        ax.set_xlabel("GRPO step")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    out.append(_save(fig, sweep.output_dir / "collapse.png"))

    pc = _pcgrad_runs(done)
    if pc:
        fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
        for arm, runs in pc.items():
            for ax, key, window in ((axes[0], "pcgrad/cosine", 5), (axes[1], "pcgrad/conflict", 10)):
                curves = [c for c in (train_curve(r, key) for r in runs) if c]
                if curves:
                    ax.plot(*mean_curve(curves, window), color=colors[arm], label=f"{arm} ({len(curves)})")
        axes[0].axhline(0, color="grey", lw=0.8)
        axes[0].set_title("cos(g_accuracy, g_reasoning)")
        axes[1].set_title("share of updates projected (conflict)")
        for ax in axes:
            ax.set_xlabel("GRPO step")
            ax.grid(alpha=0.3)
        axes[0].legend(fontsize=7)
        out.append(_save(fig, sweep.output_dir / "pcgrad.png"))

    pair = [arm for arm in CURRICULUM_PAIR if done.get(arm)]
    if pair:
        fig, axes = plt.subplots(1, len(pair), figsize=(5 * len(pair), 3.6), squeeze=False)
        for ax, arm in zip(axes[0], pair):
            runs = [accuracy_by_k(r) for r in done[arm]]
            steps = sorted(set.intersection(*(set(r) for r in runs)))
            ks = sorted({k for r in runs for s in steps for k in r[s]}, key=int)
            for k in ks:
                ax.plot(
                    steps,
                    [sum(r[s].get(k, math.nan) for r in runs) / len(runs) for s in steps],
                    marker="o",
                    ms=3,
                    label=f"k = {k}",
                )
            ax.set_title(f"{arm}: held-out accuracy by step count")
            ax.set_xlabel("GRPO step")
            ax.set_ylim(0, 1)
            ax.grid(alpha=0.3)
        axes[0][0].legend(fontsize=7)
        out.append(_save(fig, sweep.output_dir / "curriculum.png"))
    return out


#: The panels of ``variants.png``: step_diagnosis numbers over training.
VARIANT_PANELS = (
    ("accuracy", "accuracy"),
    ("steps", "steps written"),
    ("recall", "step recall"),
    ("f1_correct", "Match F1 of right answers"),
)


def validation_by_variant(run: Path, data: dict[str, dict]) -> dict[int, dict[str, dict[str, float]]]:
    """Global validation step -> variant -> the step diagnosis of that validation's samples."""
    from crystal_grpo.train.organism.step_diagnosis import diagnose_validation

    out: dict[int, dict[str, dict[str, float]]] = {}
    for phase in read_phases(run):
        for v in phase.validation:
            if (phase.folder / samples_file(v["step"])).is_file():
                out.setdefault(phase.offset + v["step"], diagnose_validation(phase.folder, v["step"], data))
    return out


def variant_runs(sweep: Sweep) -> dict[str, list[dict[int, dict[str, dict[str, float]]]]]:
    """Arm -> each finished seed's :func:`validation_by_variant` (its validation data's rows)."""
    from crystal_grpo.train.organism.step_diagnosis import rows_by_id

    runs: dict[str, list[dict]] = defaultdict(list)
    data_cache: dict[str, dict] = {}
    for p in sweep.points:
        folder = sweep.output_dir / p.name
        if (folder / "summary.json").is_file():
            path = (p.run_config or {}).get("data", {}).get("validation")
            if path:
                data = data_cache.setdefault(path, rows_by_id(path))
                runs[p.arm].append(validation_by_variant(folder, data))
    return dict(runs)


def variant_figure(sweep: Sweep, runs: dict[str, list[dict]]) -> Path | None:
    """``variants.png`` (docs/experiments.md) from :func:`variant_runs`; None when no run has validation samples."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    variants = sorted({v for rs in runs.values() for r in rs for s in r.values() for v in s})
    if not variants:
        return None
    fig, axes = plt.subplots(
        len(variants), len(VARIANT_PANELS), figsize=(4 * len(VARIANT_PANELS), 3.2 * len(variants)), squeeze=False
    )
    for i, arm in enumerate(runs):
        for row, variant in zip(axes, variants):
            for ax, (key, title) in zip(row, VARIANT_PANELS):
                curves = [{s: v[variant][key] for s, v in r.items() if variant in v} for r in runs[arm]]
                steps, means = mean_curve([c for c in curves if c])
                ax.plot(
                    steps, means, marker="o", ms=3, color=plt.get_cmap("tab10")(i % 10), label=f"{arm} ({len(curves)})"
                )
                ax.set_title(f"{variant}: {title}")
                ax.set_xlabel("GRPO step")
                ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7)
    return _save(fig, sweep.output_dir / "variants.png")


#: The columns of the curves' table (step_diagnosis numbers).
CURVE_KEYS = ("accuracy", "f1", "f1_correct", "precision", "recall", "steps")


def curves_markdown(runs: dict[str, list[dict]], keys: tuple[str, ...] = CURVE_KEYS) -> str:
    """:func:`variant_runs` as a table: one line an arm, variant and validation step (mean ± sd over the
    seeds that reached it)."""
    from crystal_grpo.train.organism.step_diagnosis import LABELS, across_seeds

    lines = [
        "| arm | variant | step | seeds | " + " | ".join(LABELS[k] for k in keys) + " |",
        "|---|---|---|---|" + "---|" * len(keys),
    ]
    for arm, seeds in runs.items():
        variants = list(dict.fromkeys(v for r in seeds for s in r.values() for v in s))
        for variant in variants:
            for step in sorted({s for r in seeds for s in r}):
                at = [r[step] for r in seeds if step in r and variant in r[step]]
                nums = across_seeds(at)[variant]
                cells = [
                    format(nums[k][0], ".3f") + (f" ± {nums[k][1]:.3f}" if math.isfinite(nums[k][1]) else "")
                    for k in keys
                ]
                lines.append(f"| {arm} | {variant} | {step} | {len(at)} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def diagnosis_markdown(sweep: Sweep, runs: dict[str, list[dict]] | None = None) -> str:
    """The step diagnosis of every evaluation of the final weights, the pre-registered contrasts, and
    with ``runs`` (:func:`variant_runs`) the validation curves by variant."""
    from crystal_grpo.train.organism.step_diagnosis import contrast_table, contrasts_markdown, sweep_table
    from crystal_grpo.train.organism.step_diagnosis import markdown as table_markdown

    lines = [f"# {sweep.name}: steps beside answers, by variant", ""]
    if not sweep.eval:
        return "\n".join(lines + ["(the sweep has no eval)", ""])
    for name, changed in {"eval": {}, **{f"eval_{n}": c for n, c in (sweep.eval.get("also") or {}).items()}}.items():
        settings = {**{k: v for k, v in sweep.eval.items() if k != "also"}, **changed}
        lines += [
            f"## {name}: {settings.get('max_samples', 'all')} rows x {settings.get('num_samples', 1)}, "
            f"temperature {settings.get('temperature', 0)}",
            "",
            table_markdown(sweep_table(sweep, name)),
        ]
    if sweep.contrasts:
        lines += [
            "## Pre-registered contrasts (Holm within each family)",
            "",
            contrasts_markdown(contrast_table(sweep)),
        ]
    if runs:
        lines += [
            "## Held-out validation over training, by variant (sampled; mean ± sd over seeds)",
            "",
            curves_markdown(runs),
        ]
    return "\n".join(lines) + "\n"


def _spread(xs: list[float]) -> str:
    """``mean [min, max]`` of the finite values (``-`` without any)."""
    xs = [x for x in xs if x is not None and math.isfinite(x)]
    if not xs:
        return "-"
    return f"{sum(xs) / len(xs):.3f}" + (f" [{min(xs):.3f}, {max(xs):.3f}]" if len(xs) > 1 else "")


#: The columns of ``training.md``'s curves: (variant, step_diagnosis number, label).
TRAINING_CURVES = (
    ("all", "accuracy", "accuracy (all)"),
    ("hinted", "recall", "recall (hinted)"),
    ("hinted", "f1", "Match F1 (hinted)"),
    ("all", "steps", "steps written (all)"),
    ("hinted", "steps", "steps written (hinted)"),
)


def training_curves_markdown(runs: dict[str, list[dict]]) -> str:
    """:func:`variant_runs` at each validation step: one line an arm and step, each column the mean over
    the seeds that reached it with their range (a variant the rows lack stays ``-``)."""
    lines = [
        "| arm | step | seeds | " + " | ".join(label for _, _, label in TRAINING_CURVES) + " |",
        "|---|---|---|" + "---|" * len(TRAINING_CURVES),
    ]
    for arm, seeds in runs.items():
        for step in sorted({s for r in seeds for s in r}):
            at = [r[step] for r in seeds if step in r]
            cells = [_spread([v[variant][key] for v in at if variant in v]) for variant, key, _ in TRAINING_CURVES]
            lines.append(f"| {arm} | {step} | {len(at)} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def kl_max(sweep: Sweep) -> dict[str, list[float]]:
    """Arm -> each finished seed's largest logged ``kl_max`` over training (every phase)."""
    return {
        arm: [max(c.values()) for c in (train_curve(r, "kl_max") for r in runs) if c]
        for arm, runs in _done(sweep).items()
    }


def accuracy_by_k_markdown(sweep: Sweep, folders: list[str]) -> str:
    """Accuracy by reference step count k, mean [seed range] per arm: on each evaluation folder of the
    final weights (``eval``, ``eval_greedy``: every row, step_diagnosis's exact scoring) and over
    validation (the sampled per-row records at each validation step)."""
    from crystal_grpo.train.organism.step_diagnosis import completions_of, rows_by_id, score

    lines = []
    data = rows_by_id(sweep.eval["data"]) if sweep.eval else {}
    for folder in folders:
        per_arm: dict[str, list[dict[int, float]]] = defaultdict(list)
        for p in sweep.points:
            ev = sweep.output_dir / p.name / folder
            if (ev / "report.json").is_file():
                by: dict[int, list[float]] = defaultdict(list)
                for s in score(*completions_of(read_jsonl(ev / "predictions.jsonl"), data)):
                    by[s["k"]].append(s["correct"])
                per_arm[p.arm].append({k: sum(xs) / len(xs) for k, xs in by.items()})
        lines += _by_k_lines(f"final weights, `{folder}`", {arm: {"": runs} for arm, runs in per_arm.items()})
    val = {arm: [accuracy_by_k(r) for r in runs] for arm, runs in _done(sweep).items()}
    val = {
        arm: {
            str(step): [{int(k): a for k, a in r[step].items()} for r in runs if step in r]
            for step in sorted({s for r in runs for s in r})
        }
        for arm, runs in val.items()
    }
    lines += _by_k_lines("validation (sampled), by step", val)
    return "\n".join(lines) + "\n"


def _by_k_lines(title: str, table: dict[str, dict[str, list[dict[int, float]]]]) -> list[str]:
    ks = sorted({k for steps in table.values() for runs in steps.values() for r in runs for k in r})
    if not ks:
        return []
    lines = [
        f"### Accuracy by reference step count: {title}",
        "",
        "| arm | step | seeds | " + " | ".join(f"k = {k}" for k in ks) + " |",
        "|---|---|---|" + "---|" * len(ks),
    ]
    for arm, steps in table.items():
        for step, runs in steps.items():
            lines.append(
                f"| {arm} | {step or 'final'} | {len(runs)} | "
                + " | ".join(_spread([r.get(k, math.nan) for r in runs]) for k in ks)
                + " |"
            )
    return lines + [""]


def training_markdown(sweep: Sweep, runs: dict[str, list[dict]]) -> str:
    """``training.md`` (docs/experiments.md)."""
    folders = ["eval", *(f"eval_{n}" for n in ((sweep.eval or {}).get("also") or {}))] if sweep.eval else []
    lines = [
        f"# {sweep.name}: over training, per arm (mean [min, max] over seeds)",
        "",
        "## Validation (sampled, held out) by step, steps matched exactly",
        "",
        training_curves_markdown(runs),
        "## KL max over training (the largest logged `kl_max` of each seed)",
        "",
        "| arm | seeds | KL max |",
        "|---|---|---|",
    ]
    lines += [f"| {arm} | {len(xs)} | {_spread(xs)} |" for arm, xs in kl_max(sweep).items()]
    lines += ["", accuracy_by_k_markdown(sweep, folders)]
    return "\n".join(lines) + "\n"


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path


def pcgrad_summary(sweep: Sweep) -> dict[str, dict[str, float]]:
    """Per PCGrad arm: mean cosine, share of updates projected, mean projected fraction."""
    out = {}
    for arm, runs in _pcgrad_runs(_done(sweep)).items():
        values: dict[str, list[float]] = defaultdict(list)
        for r in runs:
            for key in ("cosine", "conflict", "projected_fraction"):
                values[key] += list(train_curve(r, f"pcgrad/{key}").values())
        out[arm] = {k: sum(v) / len(v) for k, v in values.items() if v} | {"updates": len(values["cosine"])}
    return out


def pcgrad_windows(sweep: Sweep, width: int = 25) -> dict[str, list[dict[str, float]]]:
    """Per PCGrad arm, over windows of ``width`` global steps: mean cosine and share of updates projected
    (does a conflict appear as training goes on?)."""
    out = {}
    for arm, runs in _pcgrad_runs(_done(sweep)).items():
        cos, con = defaultdict(list), defaultdict(list)
        for r in runs:
            for step, x in train_curve(r, "pcgrad/cosine").items():
                cos[(step - 1) // width].append(x)
            for step, x in train_curve(r, "pcgrad/conflict").items():
                con[(step - 1) // width].append(x)
        out[arm] = [
            {
                "from": w * width + 1,
                "to": (w + 1) * width,
                "updates": len(cos[w]),
                "cosine": sum(cos[w]) / len(cos[w]),
                "conflict": sum(con[w]) / len(con[w]) if con[w] else math.nan,
            }
            for w in sorted(cos)
        ]
    return out


def vs_control(sweep: Sweep) -> dict[str, Any] | None:
    """Every arm against the control on the evaluation rows (paired, seeds then rows)."""
    arms = list(dict.fromkeys(p.arm for p in sweep.points))
    if CONTROL not in arms:
        return None
    return paired_on_eval(sweep, [CONTROL, *[a for a in arms if a != CONTROL]])


def markdown(sweep: Sweep) -> str:
    lines = [f"# {sweep.name}: against the control, PCGrad", ""]
    paired = vs_control(sweep)
    if paired:
        lines += [
            f"Every arm minus `{CONTROL}` on {paired['rows']} evaluation rows (mean over seeds; 95% interval "
            "resampling seeds, then rows):",
            "",
            "| arm | seeds | accuracy | diff [95% CI] | Match F1 | diff [95% CI] |",
            "|---|---|---|---|---|---|",
        ]
        for arm, m in paired["arms"].items():
            if arm == CONTROL:
                continue
            a, f = m["accuracy"], m["f1"]
            lines.append(
                f"| {arm} | {a['seeds']} | {a['mean']:.3f} | {a['diff']:+.3f} [{a['ci_low']:+.3f}, "
                f"{a['ci_high']:+.3f}] | {f['mean']:.3f} | {f['diff']:+.3f} [{f['ci_low']:+.3f}, "
                f"{f['ci_high']:+.3f}] |"
            )
        lines.append("")
    pc = pcgrad_summary(sweep)
    if pc:
        lines += [
            "| PCGrad arm | updates | mean cosine | share projected | mean projected fraction |",
            "|---|---|---|---|---|",
        ]
        for arm, s in pc.items():
            lines.append(
                f"| {arm} | {s['updates']} | {s.get('cosine', math.nan):+.3f} | "
                f"{s.get('conflict', math.nan):.3f} | {s.get('projected_fraction', math.nan):.3f} |"
            )
        lines += [
            "",
            "| PCGrad arm | global steps | updates | mean cosine | share projected |",
            "|---|---|---|---|---|",
        ]
        for arm, windows in pcgrad_windows(sweep).items():
            lines += [
                f"| {arm} | {w['from']}-{w['to']} | {w['updates']} | {w['cosine']:+.3f} | {w['conflict']:.3f} |"
                for w in windows
            ]
    return "\n".join(lines) + "\n"


def step_diagnosis_main(argv: list[str] | None = None) -> int:
    """scripts/step_diagnosis.py: the diagnosis table of evaluation folders or of a sweep's points."""
    import argparse

    from crystal_grpo.train.organism.step_diagnosis import (
        across_seeds,
        diagnose_eval,
        markdown,
        rows_by_id,
        sweep_table,
    )

    ap = argparse.ArgumentParser(
        description="Steps beside answers: F1 on right and wrong answers, steps, answer = "
        "last step, the slip model's F1, by variant (docs/experiments.md)."
    )
    what = ap.add_mutually_exclusive_group(required=True)
    what.add_argument(
        "--eval",
        nargs="+",
        metavar="DIR[,DIR...]",
        help="evaluation folders (scripts/evaluate.py --out); comma-separated folders are one arm's seeds",
    )
    what.add_argument("--sweep", type=user_path, help="a sweep YAML: every arm's evaluated points")
    ap.add_argument("--data", type=user_path, help="the evaluated data (JSONL; default with --sweep: its eval.data)")
    ap.add_argument("--output_dir", type=user_path, help="the sweep folder (default: the sweep's)")
    ap.add_argument("--folder", default="eval", help="with --sweep: each point's evaluation subfolder (default eval)")
    a = ap.parse_args(argv)
    if a.sweep:
        sweep = load_sweep(a.sweep, a.output_dir, resolve_init=False)
        if a.data:
            sweep.eval = {**sweep.eval, "data": a.data}
        table = sweep_table(sweep, a.folder)
    else:
        if not a.data:
            ap.error("--data is required with --eval")
        data = rows_by_id(a.data)
        table = {arm: across_seeds([diagnose_eval(f, data) for f in arm.split(",")]) for arm in a.eval}
    print(markdown(table), end="")
    return 0


def main(argv: list[str] | None = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(
        description="The report of a reward ablation: the sweep's table, collapse, PCGrad, "
        "curriculum, the control, steps by variant, pre-registered contrasts."
    )
    ap.add_argument("sweep", type=user_path, help="the sweep YAML (e.g. configs/sweeps/organism_ablation.yaml)")
    ap.add_argument("--output_dir", type=user_path, help="the sweep folder (default: the sweep's)")
    a = ap.parse_args(argv)
    sweep = load_sweep(a.sweep, a.output_dir, resolve_init=False)
    report, _ = write_report(sweep)  # the sweep's own report.md (scripts/sweep.py --report)
    text = markdown(sweep)
    atomic_write_text(sweep.output_dir / "vs_control.md", text)
    runs = variant_runs(sweep)
    paths = figures(sweep) + [p for p in (variant_figure(sweep, runs),) if p]
    atomic_write_text(sweep.output_dir / "pcgrad_summary.json", json.dumps(pcgrad_summary(sweep), indent=2))
    diagnosis = diagnosis_markdown(sweep, runs)
    atomic_write_text(sweep.output_dir / "diagnosis.md", diagnosis)
    training = training_markdown(sweep, runs)
    atomic_write_text(sweep.output_dir / "training.md", training)
    print(report + "\n" + text + "\n" + diagnosis + "\n" + training + "".join(f"\nplot: {p}" for p in paths))
    return 0

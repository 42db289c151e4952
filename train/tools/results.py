"""An experiment's per-seed results, committed beside the docs, and the tables generated from them.

A finished experiment's numbers live in ``docs/results/<name>.csv``: one row per arm, seed,
evaluation and variant of the rows, holding the step diagnosis' numbers
(train/organism/step_diagnosis.py), collected from the sweeps' run folders. ``<name>.yaml`` beside it
names those sweeps, the methods and the values of the task's axis the arms cross (an arm is
``<method>_r<value>``), and the pre-registered contrasts. Every table the README and the docs show
from it is generated here and sits between ``<!-- results NAME TABLE -->`` and ``<!-- /results -->``
markers, which ``scripts/results.py --check`` (and the tests) compare with what the CSV gives: a reader
recomputes every number without the run folders, and no table drifts from its data.
"""

from __future__ import annotations

import csv
import io
import math
import re
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from crystal_grpo.errors import CrystalError
from crystal_grpo.stats import contrast_rows, rate_interval
from crystal_grpo.train.organism.step_diagnosis import (
    BINARY,
    LABELS,
    SUMMARY,
    across_seeds,
    contrasts_markdown,
    per_seed_named,
)

COLUMNS = ("arm", "seed", "eval", "variant", *SUMMARY)
#: ``<!-- results NAME TABLE -->`` ... ``<!-- /results -->`` in a markdown file.
BLOCK = re.compile(r"(<!-- results (\S+) (\S+) -->\n)(.*?)(<!-- /results -->)", re.S)


class ResultsError(CrystalError, ValueError):
    """An experiment file or results file that cannot be read; the message names it."""


@dataclass
class Experiment:
    """``docs/results/<name>.yaml``: where the numbers come from and how they are read."""

    name: str
    path: Path
    sweeps: list[str]
    methods: dict[str, str]  #: method -> its label in tables, in table order
    axis: str  #: the task's knob the arms cross, e.g. ``r``
    values: list[str]  #: its values, in column order (an arm is ``<method>_<axis><value>``)
    contrasts: list[dict[str, str]] = field(default_factory=list)

    @property
    def csv(self) -> Path:
        return self.path.with_suffix(".csv")

    def arm(self, method: str, value: str) -> str:
        return f"{method}_{self.axis}{value}"


def load_experiment(path: str | Path) -> Experiment:
    import yaml

    path = Path(path)
    try:
        raw = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError) as err:
        raise ResultsError(f"{path}: {err}") from None
    keys = {"sweeps", "methods", "axis", "values", "contrasts"}
    if not isinstance(raw, dict) or set(raw) - keys or not {"methods", "axis", "values"} <= set(raw):
        raise ResultsError(f"{path}: expected a mapping with methods, axis, values (and sweeps, contrasts)")
    methods = raw["methods"]
    if not isinstance(methods, dict) or not methods:
        raise ResultsError(f"{path}: methods: expected a mapping of method: label")
    return Experiment(
        name=path.stem,
        path=path,
        sweeps=[str(s) for s in raw.get("sweeps") or []],
        methods={str(k): str(v) for k, v in methods.items()},
        axis=str(raw["axis"]),
        values=[str(v) for v in raw["values"]],
        contrasts=[{k: str(v) for k, v in c.items()} for c in raw.get("contrasts") or []],
    )


# ---------------------------------------------------------------------------------- the CSV
def collect(experiment: Experiment, folders: Sequence[str] = ("eval", "eval_greedy")) -> list[dict]:
    """Rows of the CSV from the experiment's sweeps' evaluated points (the run folders)."""
    from crystal_grpo.train.tools.sweep import load_sweep

    rows = []
    for sweep_file in experiment.sweeps:
        sweep = load_sweep(sweep_file, resolve_init=False)
        for folder in folders:
            for arm, seed, by_variant in per_seed_named(sweep, folder):
                for variant, numbers in by_variant.items():
                    rows.append({"arm": arm, "seed": seed, "eval": folder, "variant": variant, **numbers})
    return rows


def write_csv(rows: Sequence[Mapping], path: Path) -> None:
    out = io.StringIO()
    writer = csv.DictWriter(out, COLUMNS, lineterminator="\n")
    writer.writeheader()
    for r in sorted(rows, key=lambda r: (r["arm"], int(r["seed"]), r["eval"], r["variant"])):
        writer.writerow({k: _cell(r[k]) for k in COLUMNS})
    path.write_text(out.getvalue(), encoding="utf-8")


def _cell(value) -> str:
    if isinstance(value, float):
        return "nan" if not math.isfinite(value) else format(value, ".6g")
    return str(value)


def read_csv(path: Path) -> list[dict]:
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as err:
        raise ResultsError(f"{path}: {err.strerror or err}") from None
    rows = list(csv.DictReader(io.StringIO(text)))
    if rows and set(COLUMNS) - set(rows[0]):
        raise ResultsError(f"{path}: columns {sorted(set(COLUMNS) - set(rows[0]))} missing")
    for r in rows:
        r["seed"] = int(r["seed"])
        for k in SUMMARY:
            r[k] = float(r[k])
    return rows


def seeds_by_arm(rows: Sequence[Mapping], folder: str) -> dict[str, list[dict[str, dict[str, float]]]]:
    """Arm -> its seeds (in seed order), each ``{variant: {number: value}}`` on evaluation ``folder``."""
    runs: dict[str, dict[int, dict]] = defaultdict(lambda: defaultdict(dict))
    for r in rows:
        if r["eval"] == folder:
            runs[r["arm"]][r["seed"]][r["variant"]] = {k: r[k] for k in SUMMARY}
    return {arm: [seeds[s] for s in sorted(seeds)] for arm, seeds in runs.items()}


# ---------------------------------------------------------------------------------- tables
def _num(x: float, f: str = ".3f") -> str:
    return "-" if x is None or not math.isfinite(x) else format(x, f)


def _values(runs_by_arm: Mapping[str, list], arm: str, variant: str, key: str) -> list[float]:
    """One number of each seed of ``arm`` (from :func:`seeds_by_arm`), the non-finite left out."""
    runs = runs_by_arm.get(arm, [])
    return [run[variant][key] for run in runs if variant in run and math.isfinite(run[variant][key])]


def hold_table(experiment: Experiment, rows: Sequence[Mapping]) -> str:
    """Per method and axis value: how many seeds hold the chain (greedy, hinted rows), the rate's
    exact 95% interval."""
    head = [f"{experiment.axis} = {v}" for v in experiment.values]
    lines = ["| reward | " + " | ".join(head) + " |", "|---|" + "---|" * len(head)]
    greedy = seeds_by_arm(rows, "eval_greedy")
    for method, label in experiment.methods.items():
        cells = []
        for v in experiment.values:
            xs = _values(greedy, experiment.arm(method, v), "hinted", "holds")
            if not xs:
                cells.append("-")
                continue
            yes = int(sum(xs))
            lo, hi = rate_interval(yes, len(xs))
            cells.append(f"{yes}/{len(xs)} [{lo:.2f}, {hi:.2f}]")
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


#: The metrics table's columns: (evaluation, variant, number).
METRICS = (
    ("eval_greedy", "all", "accuracy"),
    ("eval_greedy", "hinted", "f1"),
    ("eval_greedy", "hinted", "copies_hint"),
    ("eval", "all", "accuracy"),
    ("eval", "hinted", "f1"),
)


def metrics_table(experiment: Experiment, rows: Sequence[Mapping], value: str) -> str:
    """Mean ± sd over seeds of :data:`METRICS`, one row a method, at one value of the axis."""
    heads = [
        f"{LABELS[k]} ({'all' if v == 'all' else v}, {'greedy' if e == 'eval_greedy' else 'sampled'})"
        for e, v, k in METRICS
    ]
    lines = ["| reward | seeds | " + " | ".join(heads) + " |", "|---|---|" + "---|" * len(heads)]
    runs_by_arm = {e: seeds_by_arm(rows, e) for e in dict.fromkeys(e for e, _, _ in METRICS)}
    for method, label in experiment.methods.items():
        arm = experiment.arm(method, value)
        summary = {e: across_seeds(runs.get(arm, [])) for e, runs in runs_by_arm.items()}
        seeds = max(len(_values(runs_by_arm[e], arm, v, k)) for e, v, k in METRICS)
        cells = []
        for e, v, k in METRICS:
            mu, sd = summary[e].get(v, {}).get(k, (math.nan, math.nan))
            cells.append(_num(mu) + (f" ± {sd:.3f}" if math.isfinite(sd) else ""))
        if seeds:
            lines.append(f"| {label} | {seeds} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def seeds_table(experiment: Experiment, rows: Sequence[Mapping]) -> str:
    """One line a run: the hint restated, whether it holds the chain and the accuracy (greedy), the
    hinted Match F1 (sampled)."""
    at = {(r["arm"], r["seed"], r["eval"], r["variant"]): r for r in rows}
    order = [experiment.arm(m, v) for v in experiment.values for m in experiment.methods]
    runs = sorted(
        {(r["arm"], r["seed"]) for r in rows}, key=lambda x: (order.index(x[0]) if x[0] in order else -1, x[1])
    )
    lines = [
        "| arm | seed | hint restated (hinted, greedy) | holds the chain | accuracy (greedy) "
        "| Match F1 (hinted, sampled) |",
        "|---|---|---|---|---|---|",
    ]
    for arm, seed in runs:
        hinted, every, sampled = (
            at.get((arm, seed, e, v))
            for e, v in (("eval_greedy", "hinted"), ("eval_greedy", "all"), ("eval", "hinted"))
        )
        cells = [
            _num(hinted["copies_hint"]) if hinted else "-",
            ("yes" if hinted["holds"] else "no") if hinted else "-",
            _num(every["accuracy"]) if every else "-",
            _num(sampled["f1"]) if sampled else "-",
        ]
        lines.append(f"| {arm} | {seed} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def contrasts_table(experiment: Experiment, rows: Sequence[Mapping]) -> str:
    return contrasts_markdown(contrast_rows(experiment.contrasts, lambda folder: seeds_by_arm(rows, folder)))


def tables(experiment: Experiment, rows: Sequence[Mapping]) -> dict[str, str]:
    """Every table a doc may show from this experiment, by the name its marker gives."""
    out = {
        "holds": hold_table(experiment, rows),
        "contrasts": contrasts_table(experiment, rows),
        "seeds": seeds_table(experiment, rows),
    }
    for v in experiment.values:
        out[f"metrics_{experiment.axis}{v}"] = metrics_table(experiment, rows, v)
    return out


def check_contrasts(experiment: Experiment) -> None:
    """Each contrast names arms of the experiment, a known number, and fits its test."""
    arms = {experiment.arm(m, v) for m in experiment.methods for v in experiment.values}
    for i, c in enumerate(experiment.contrasts):
        bad = [f"arm {c.get(k)!r}" for k in ("a", "b") if c.get(k) not in arms]
        bad += [f"metric {c.get('metric')!r}"] if c.get("metric") not in SUMMARY else []
        bad += (
            [f"fisher on {c.get('metric')!r}"] if c.get("test") == "fisher" and c.get("metric") not in BINARY else []
        )
        if bad:
            raise ResultsError(f"{experiment.path}: contrasts[{i}]: no {'; no '.join(bad)}")


def figure(experiment: Experiment, rows: Sequence[Mapping], path: Path) -> Path:
    """Left: each method's hold rate at each value of the axis, with its exact 95% interval; right:
    each run's greedy share of hinted answers restating the hint (a dot a seed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    methods = [m for m in experiment.methods if any(r["arm"].startswith(m + "_") for r in rows)]
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 0.55 * len(methods) + 1.6), sharey=True)
    width = 0.8 / len(experiment.values)
    greedy = seeds_by_arm(rows, "eval_greedy")
    for k, v in enumerate(experiment.values):
        ys, rates, lows, highs, dots_x, dots_y = [], [], [], [], [], []
        for i, m in enumerate(methods):
            xs = _values(greedy, experiment.arm(m, v), "hinted", "holds")
            copies = _values(greedy, experiment.arm(m, v), "hinted", "copies_hint")
            y = i + (k - (len(experiment.values) - 1) / 2) * width
            dots_x += copies
            dots_y += [y] * len(copies)
            if xs:
                yes = int(sum(xs))
                lo, hi = rate_interval(yes, len(xs))
                ys.append(y)
                rates.append(yes / len(xs))
                lows.append(yes / len(xs) - lo)
                highs.append(hi - yes / len(xs))
        label = f"{experiment.axis} = {v}"
        left.barh(ys, rates, height=width * 0.9, xerr=[lows, highs], capsize=3, label=label, color=f"C{k}")
        right.scatter(dots_x, dots_y, s=14, alpha=0.6, color=f"C{k}", label=label)
    left.set_yticks(range(len(methods)), [experiment.methods[m] for m in methods])
    left.invert_yaxis()
    left.set_xlim(0, 1)
    left.set_xlabel("share of seeds holding the chain (95% exact interval)")
    right.axvline(0.10, color="grey", lw=0.8, ls="--")
    right.set_xlim(-0.02, 1.02)
    right.set_xlabel("hinted answers restating the hint (greedy), a dot a seed")
    left.legend(loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# ------------------------------------------------------------------------------- the docs
def render(text: str, generated: Mapping[str, Mapping[str, str]]) -> str:
    """``text`` with every results block replaced by its generated table (a block naming an unknown
    experiment or table is an error)."""

    def block(m: re.Match) -> str:
        name, table = m.group(2), m.group(3)
        if table not in generated.get(name, {}):
            raise ResultsError(f"results block {name} {table}: no such experiment or table")
        return m.group(1) + generated[name][table] + m.group(5)

    return BLOCK.sub(block, text)


def blocks_in(text: str) -> set[str]:
    """The experiments whose tables a markdown text shows."""
    return {m.group(2) for m in BLOCK.finditer(text)}


#: The markdown files whose results blocks are generated.
DOCS = ("README.md", "docs/experiments.md", "docs/organism.md")


def generated_for(texts: Sequence[str], results: Path) -> dict[str, dict[str, str]]:
    """The tables of every experiment the texts show, from ``results/<name>.yaml`` and its CSV."""
    out = {}
    for name in sorted(set().union(*(blocks_in(t) for t in texts))):
        experiment = load_experiment(results / f"{name}.yaml")
        check_contrasts(experiment)
        out[name] = tables(experiment, read_csv(experiment.csv))
    return out


def main(argv: Sequence[str] | None = None) -> int:
    """``scripts/results.py``: collect an experiment's per-seed CSV from its run folders, or write (or
    check) the tables the docs show from the committed CSVs."""
    import argparse

    ap = argparse.ArgumentParser(description="Per-seed results beside the docs, and the tables made from them.")
    sub = ap.add_subparsers(dest="command", required=True)
    c = sub.add_parser("collect", help="write the per-seed CSV beside the experiment file from its run folders")
    c.add_argument("experiment", help="an experiment file, e.g. docs/results/when_steps_hold.yaml")
    f = sub.add_parser("figure", help="the hold rates and each run's hint copying, from the committed CSV")
    f.add_argument("experiment", help="an experiment file, e.g. docs/results/when_steps_hold.yaml")
    f.add_argument("--out", required=True, help="the PNG to write")
    w = sub.add_parser("tables", help="regenerate every results block of the docs from the committed CSVs")
    w.add_argument("--check", action="store_true", help="change nothing; exit 1 when a block differs")
    w.add_argument("--root", default=".", help="the repository (default: here)")
    a = ap.parse_args(argv)
    try:
        if a.command == "collect":
            experiment = load_experiment(a.experiment)
            check_contrasts(experiment)
            rows = collect(experiment)
            write_csv(rows, experiment.csv)
            print(f"{experiment.csv}: {len(rows)} rows, {len({(r['arm'], r['seed']) for r in rows})} runs")
            return 0
        if a.command == "figure":
            experiment = load_experiment(a.experiment)
            print(figure(experiment, read_csv(experiment.csv), Path(a.out)))
            return 0
        root = Path(a.root)
        paths = [root / p for p in DOCS if (root / p).is_file()]
        texts = [p.read_text(encoding="utf-8") for p in paths]
        generated = generated_for(texts, root / "docs" / "results")
        stale = []
        for path, text in zip(paths, texts):
            new = render(text, generated)
            if new != text:
                stale.append(str(path))
                if not a.check:
                    path.write_text(new, encoding="utf-8")
        if a.check and stale:
            print(f"results blocks differ from the committed CSVs in: {', '.join(stale)} (scripts/results.py tables)")
            return 1
        print(("rewritten: " if stale else "up to date: ") + ", ".join(stale or map(str, paths)))
        return 0
    except ResultsError as err:
        print(f"error: {err}")
        return 2

"""What a policy's steps are worth beside its answers, on the model organism (docs/experiments.md,
"Diagnosis"): Match F1 on right and on wrong answers, steps written, whether the answer is the
last step's own result, split by the rows' ``variant`` (plain, hinted, ...), and the Match F1
that accuracy alone predicts when every step slips independently.

Why: with exact matching, a slip breaks every later step of the organism's chain, so a policy
whose only flaw is slipping has a Match F1 fixed by its accuracy (:func:`slip_model_f1`). A
reward makes better *steps* only where F1 departs from that curve, or where the steps of right
answers differ. Completions are scored again here with the exact matcher (any source: an
evaluation's ``predictions.jsonl``, validation's samples), so every cut reads one scorer.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

from crystal_grpo.jsonl import read_jsonl
from crystal_grpo.stats import contrast_rows, finite_mean
from crystal_grpo.train.organism.task import stated_result
from crystal_grpo.train.run.layout import samples_file

#: Per-completion fields of :func:`score`, and the group summaries of :func:`summarize`, in report order.
SUMMARY = (
    "n",
    "accuracy",
    "f1",
    "f1_correct",
    "f1_wrong",
    "precision",
    "recall",
    "steps",
    "steps_per_ref",
    "answer_is_last",
    "copies_hint",
    "holds",
    "slip_f1",
    "f1_over_slip",
)
#: A run "holds the chain" on a set of rows when fewer than this share of its completions restate the hint.
HOLD_BELOW = 0.10
#: Numbers that are 0 or 1 for one run, read across seeds by Fisher's exact test.
BINARY = ("holds",)
LABELS = {
    "n": "completions",
    "accuracy": "accuracy",
    "f1": "Match F1",
    "f1_correct": "F1 (right)",
    "f1_wrong": "F1 (wrong)",
    "precision": "precision",
    "recall": "recall",
    "steps": "steps",
    "steps_per_ref": "steps / k",
    "answer_is_last": "answer = last step",
    "copies_hint": "hint copied",
    "holds": "holds the chain",
    "slip_f1": "slip-model F1",
    "f1_over_slip": "F1 − slip model",
}


def slip_accuracy(p: float, ks: Sequence[int]) -> float:
    """Accuracy of a policy that slips each step with chance ``p``, over rows of ``ks`` steps."""
    return sum((1 - p) ** k for k in ks) / len(ks)


def slip_f1(p: float, ks: Sequence[int]) -> float:
    """Its exact-match F1: it writes k steps, and those before the first slip match (P = R)."""
    return sum(sum((1 - p) ** i for i in range(1, k + 1)) / k for k in ks) / len(ks)


def slip_model_f1(accuracy: float, ks: Sequence[int]) -> float:
    """The Match F1 that ``accuracy`` implies under independent per-step slips (no other flaw):
    the slip chance that gives this accuracy on these rows, then its F1 (bisection; a slip that a
    later one cancels is ignored)."""
    if not ks or not math.isfinite(accuracy):
        return math.nan
    lo, hi = 0.0, 1.0
    for _ in range(60):  # slip_accuracy falls as p rises
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if slip_accuracy(mid, ks) > accuracy else (lo, mid)
    return slip_f1((lo + hi) / 2, ks)


def score(texts: Sequence[str], rows: Sequence[Mapping]) -> list[dict]:
    """Each completion against its row (exact step matching): correct, F1, precision, recall,
    steps, whether its answer is its last step's result (None without steps), and whether a step
    repeats a span of the question (the hinted organism's shortcut: "We are told c is 2.")."""
    from crystal_grpo.rewards import build_reward
    from crystal_grpo.rewards.answers import answers_match

    module = build_reward("answer_only", encoder="exact", device="cpu")
    scored = module.score(list(texts), list(rows), with_steps=True)
    values = {k: v.tolist() for k, v in module.per_row(scored.batch).items()}
    out = []
    for i, (parsed, row) in enumerate(zip(scored.parsed, rows)):
        last = stated_result(parsed.steps[-1]) if parsed.steps else None
        out.append(
            {
                "variant": row.get("variant", "plain"),
                "hint_true": row.get("hint_true"),
                "k": len(row["reference_steps"]),
                "correct": values["accuracy"][i],
                "f1": values["f1"][i],
                "precision": values["precision"][i],
                "recall": values["recall"][i],
                "steps": values["steps_mean"][i],
                "answer_is_last": (
                    None if last is None else float(parsed.answer is not None and answers_match(parsed.answer, last))
                ),
                "copies_hint": float(any(s.strip() and s.strip() in row["question"] for s in parsed.steps)),
            }
        )
    return out


def summarize(scored: Sequence[dict]) -> dict[str, float]:
    """One group of :func:`score`'s completions: the :data:`SUMMARY` numbers."""
    right, wrong = [s for s in scored if s["correct"] > 0], [s for s in scored if s["correct"] <= 0]
    acc = finite_mean(s["correct"] for s in scored)
    model = slip_model_f1(acc, [s["k"] for s in scored])
    f1 = finite_mean(s["f1"] for s in scored)
    copies = finite_mean(s["copies_hint"] for s in scored)
    return {
        "n": len(scored),
        "accuracy": acc,
        "f1": f1,
        "f1_correct": finite_mean(s["f1"] for s in right),
        "f1_wrong": finite_mean(s["f1"] for s in wrong),
        "precision": finite_mean(s["precision"] for s in scored),
        "recall": finite_mean(s["recall"] for s in scored),
        "steps": finite_mean(s["steps"] for s in scored),
        "steps_per_ref": finite_mean(s["steps"] / s["k"] for s in scored),
        "answer_is_last": finite_mean(s["answer_is_last"] for s in scored),
        "copies_hint": copies,
        "holds": float(copies < HOLD_BELOW) if math.isfinite(copies) else math.nan,
        "slip_f1": model,
        "f1_over_slip": f1 - model,
    }


def by_variant(scored: Sequence[dict]) -> dict[str, dict[str, float]]:
    """:func:`summarize` over all completions (``all``), over each variant, and where some hints
    state a wrong value (the task's ``hint_reliability``) over the true and the false hints apart."""
    groups: dict[str, list[dict]] = defaultdict(list)
    for s in scored:
        groups[s["variant"]].append(s)
    if any(s.get("hint_true") is False for s in scored):
        for s in scored:
            if s.get("hint_true") is not None:
                groups[f"{s['variant']} ({'true' if s['hint_true'] else 'false'} hint)"].append(s)
    out = {"all": summarize(scored)}
    out.update({v: summarize(groups[v]) for v in sorted(groups)})
    return out


def completions_of(records: Iterable[Mapping], data: Mapping[str, Mapping]) -> tuple[list[str], list[Mapping]]:
    """(texts, their data rows) of records holding ``id`` and ``completion`` (an evaluation's
    ``predictions.jsonl``, validation's samples), joined with the data rows by id."""
    texts, rows = [], []
    for r in records:
        if r["id"] not in data:
            raise ValueError(f"completion of row {r['id']!r}: no such row in the data")
        texts.append(r.get("completion") or "")
        rows.append(data[r["id"]])
    return texts, rows


def rows_by_id(path: str | Path) -> dict[str, dict]:
    return {r["id"]: r for r in read_jsonl(Path(path))}


def diagnose_eval(folder: str | Path, data: Mapping[str, Mapping]) -> dict[str, dict[str, float]]:
    """An evaluation folder (``scripts/evaluate.py --out``), by variant."""
    return by_variant(score(*completions_of(read_jsonl(Path(folder) / "predictions.jsonl"), data)))


def diagnose_validation(phase: str | Path, step: int, data: Mapping[str, Mapping]) -> dict[str, dict[str, float]]:
    """A run phase's validation at ``step`` (its samples file), by variant."""
    return by_variant(score(*completions_of(read_jsonl(Path(phase) / samples_file(step)), data)))


def across_seeds(runs: Sequence[Mapping[str, Mapping[str, float]]]) -> dict[str, dict[str, tuple[float, float]]]:
    """Per variant and number: (mean, sample sd) over runs (sd NaN with one run)."""
    out: dict[str, dict[str, tuple[float, float]]] = {}
    for variant in dict.fromkeys(v for r in runs for v in r):
        out[variant] = {}
        for key in SUMMARY:
            xs = [r[variant][key] for r in runs if variant in r and math.isfinite(r[variant][key])]
            mu = sum(xs) / len(xs) if xs else math.nan
            sd = math.sqrt(sum((x - mu) ** 2 for x in xs) / (len(xs) - 1)) if len(xs) > 1 else math.nan
            out[variant][key] = (mu, sd)
    return out


def markdown(
    table: Mapping[str, Mapping[str, Mapping[str, tuple[float, float]]]], keys: Sequence[str] = SUMMARY
) -> str:
    """Rows ``name / variant``, one column a number (mean ± sd over seeds where there are several)."""
    lines = ["| arm | variant | " + " | ".join(LABELS[k] for k in keys) + " |", "|---|---|" + "---|" * len(keys)]
    for name, variants in table.items():
        for variant, nums in variants.items():
            cells = []
            for k in keys:
                mu, sd = nums[k]
                fmt = ".0f" if k == "n" else ("+.3f" if k == "f1_over_slip" else ".3f")
                cells.append(
                    "-"
                    if not math.isfinite(mu)
                    else format(mu, fmt) + (f" ± {sd:.3f}" if math.isfinite(sd) and k != "n" else "")
                )
            lines.append(f"| {name} | {variant} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def per_seed_named(sweep, folder: str = "eval") -> list[tuple[str, int | None, dict[str, dict[str, float]]]]:
    """(arm, seed, numbers by variant) of each point of a sweep (train/tools/sweep.py) whose ``folder``
    is evaluated, on the data it was evaluated on (the sweep's ``eval.data``, or the point's own), in
    the sweep's order."""
    data: dict[str, dict] = {}
    out = []
    for p in sweep.points:
        ev = sweep.output_dir / p.name / folder
        if (ev / "report.json").is_file():
            path = str(sweep.eval_for(p)["data"])
            out.append((p.arm, p.seed, diagnose_eval(ev, data.setdefault(path, rows_by_id(path)))))
    return out


def per_seed(sweep, folder: str = "eval") -> dict[str, list[dict[str, dict[str, float]]]]:
    """Per arm of a sweep: each evaluated seed's numbers by variant (:func:`per_seed_named`)."""
    out: dict[str, list] = defaultdict(list)
    for arm, _, numbers in per_seed_named(sweep, folder):
        out[arm].append(numbers)
    return dict(out)


def sweep_table(sweep, folder: str = "eval") -> dict[str, dict[str, dict[str, tuple[float, float]]]]:
    """:func:`per_seed` as mean ± sd over each arm's seeds."""
    return {arm: across_seeds(runs) for arm, runs in per_seed(sweep, folder).items()}


def contrast_table(sweep, alpha: float = 0.05) -> list[dict]:
    """The sweep's pre-registered ``contrasts`` read from its points' evaluations (crystal_grpo/stats.py's
    ``contrast_rows``)."""
    return contrast_rows(sweep.contrasts, lambda folder: per_seed(sweep, folder), alpha)


def contrasts_markdown(rows: Sequence[Mapping]) -> str:
    """One line a contrast: its family, the two arms' seed means (for Fisher: how many seeds hold, and
    the rate's exact interval at the family's adjusted level), b − a with its 95% t-interval (not
    adjusted) and the interval at the adjusted level, Welch's or Fisher's p, the permutation p, Holm's
    p within the family, and the seeds per arm a difference of this size needs at Holm's first threshold."""
    num = lambda x, f=".3f": "-" if x is None or not math.isfinite(x) else format(x, f)
    lines = [
        "| family | evaluation | variant | metric | test | a | b | seeds | a | b | b − a [95%, not adjusted] "
        "| [adjusted] | p | p (permutation) | p (Holm) | seeds needed |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if r["test"] == "fisher":
            ya, yb = r["yes"]
            means = [
                f"{y}/{n} [{num(lo, '.2f')}, {num(hi, '.2f')}]"
                for y, n, (lo, hi) in ((ya, r["seeds"][0], r["rate_a"]), (yb, r["seeds"][1], r["rate_b"]))
            ]
            interval, adjusted, perm = num(r["diff"], "+.3f"), "-", "-"
        else:
            means = [num(r["mean_a"]), num(r["mean_b"])]
            interval = f"{num(r['diff'], '+.3f')} [{num(r['low'], '+.3f')}, {num(r['high'], '+.3f')}]"
            adjusted = f"[{num(r['low_adjusted'], '+.3f')}, {num(r['high_adjusted'], '+.3f')}]"
            perm = num(r["p_perm"])
        lines.append(
            f"| {r['family']} | {r['eval']} | {r['variant']} | {LABELS[r['metric']]} | {r['test']} | {r['a']} | "
            f"{r['b']} | {r['seeds'][0]}, {r['seeds'][1]} | {means[0]} | {means[1]} | {interval} | {adjusted} | "
            f"{num(r['p'])} | {perm} | {num(r['p_holm'])} | {r['seeds_needed'] or '-'} |"
        )
    return "\n".join(lines) + "\n"

"""Score predicted reasoning steps against reference chains (Match F1, docs/method.md sections 1, 3, 4).

    crystal-grpo-score --predictions preds.jsonl --data data.jsonl --out report.json

Prediction rows: ``{"id", "reasoning_steps": [...], "answer"}``; data rows follow docs/method.md
section 1 (``reference_sets``, when present, compete with ``reference_steps``: best chain
wins). Only steps are scored here, not answers. Examples without a prediction and
predictions for unknown ids are listed in the report and printed as warnings; they are
not scored. Malformed input (or an encoder that cannot load) exits with code 2.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections import defaultdict
from pathlib import Path

from crystal_grpo.jsonl import Unreadable, iter_jsonl
from crystal_grpo.paths import user_file, user_path
from crystal_grpo.rewards.answer_only import AnswerOnlyReward
from crystal_grpo.rewards.encoder import EXACT, PACKAGED_MINILM, PAPER_ENCODER, EncoderLoadError
from crystal_grpo.rewards.match_f1 import MatchF1Scorer
from crystal_grpo.rewards.parsing import ParsedOutput
from crystal_grpo.rewards.text import clean_text

METRICS = ("precision", "recall", "f1", "lis_ratio", "ordered_f1")
MAX_ERRORS = 20


def _is_str_list(x) -> bool:
    return isinstance(x, list) and all(isinstance(s, str) for s in x)


def _is_scalar(x) -> bool:
    """A string or a finite number: json.loads reads NaN, Infinity and 1e999 as floats,
    but none of them is a JSON number or an answer."""
    if isinstance(x, float):
        return math.isfinite(x)
    return isinstance(x, (str, int)) and not isinstance(x, bool)


# (field, required, check, what it must be) for each kind of row.
PRED_FIELDS = [
    ("reasoning_steps", True, _is_str_list, "a list of strings"),
    ("answer", True, lambda x: x is None or _is_scalar(x), "a string, a finite number or null"),
]
DATA_FIELDS = [
    ("question", True, lambda x: isinstance(x, str), "a string"),
    ("answer", True, _is_scalar, "a string or a finite number"),
    ("reference_steps", True, lambda x: _is_str_list(x) and any(s.strip() for s in x), "a non-empty list of strings"),
    (
        "reference_sets",
        False,
        lambda x: isinstance(x, list) and all(map(_is_str_list, x)),
        "a list of lists of strings",
    ),
    ("source", False, lambda x: isinstance(x, str), "a string"),
]


def _check(fields, row: dict) -> str | None:
    for key, required, ok, what in fields:
        if key not in row:
            if required:
                return f"missing field {key!r}"
        elif not (ok(row[key]) or (not required and row[key] is None)):
            return f"{key!r} must be {what}"
    return None


def read_jsonl(path: Path, fields, errors: list[str]) -> dict[str, dict]:
    """Rows keyed by ``str(id)`` in file order; problems are appended to ``errors``."""
    rows: dict[str, dict] = {}
    first_line: dict[str, int] = {}
    for n, row in iter_jsonl(path):
        if isinstance(row, Unreadable):
            errors.append(f"{path}:{n}: {row.problem}")
            continue
        if not isinstance(row, dict):
            errors.append(f"{path}:{n}: expected a JSON object, got {type(row).__name__}")
            continue
        rid = row.get("id")
        if rid is None or isinstance(rid, bool) or not isinstance(rid, (str, int)):
            errors.append(
                f"{path}:{n}: missing field 'id' (a string or integer)"
                if rid is None
                else f"{path}:{n}: 'id' must be a string or integer"
            )
            continue
        problem = _check(fields, row)
        if problem:
            errors.append(f"{path}:{n}: id {rid!r}: {problem}")
        elif str(rid) in first_line:
            errors.append(f"{path}:{n}: duplicate id {rid!r} (first on line {first_line[str(rid)]})")
        else:
            first_line[str(rid)] = n
            rows[str(rid)] = row
    return rows


def _summary(examples: list[dict]) -> dict:
    n = len(examples)
    out = {k: (sum(e[k] for e in examples) / n if n else None) for k in METRICS}
    out["mean_pred_steps"] = sum(e["n_pred"] for e in examples) / n if n else None
    out["mean_ref_steps"] = sum(e["n_ref"] for e in examples) / n if n else None
    out["n"] = n
    return out


def format_table(rows: dict[str, dict]) -> str:
    head = ["subset", "precision", "recall", "match_f1", "lis_ratio", "ordered_f1", "pred_steps", "n"]
    keys = (*METRICS, "mean_pred_steps")
    body = [
        [clean_text(name)] + ["-" if m[k] is None else f"{m[k]:.3f}" for k in keys] + [str(m["n"])]
        for name, m in rows.items()
    ]
    widths = [max(len(r[i]) for r in [head, *body]) for i in range(len(head))]
    fmt = lambda r: "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
    return "\n".join([fmt(head), fmt(["-" * w for w in widths]), *map(fmt, body)])


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="crystal-grpo-score", description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--predictions",
        required=True,
        type=user_file,
        metavar="JSONL",
        help='prediction rows {"id", "reasoning_steps": [...], "answer"}, one JSON object a line',
    )
    p.add_argument(
        "--data",
        required=True,
        type=user_file,
        metavar="JSONL",
        help="data rows of docs/method.md section 1 (id, question, answer, reference_steps, optional "
        "reference_sets and source), one JSON object a line",
    )
    p.add_argument(
        "--out",
        required=True,
        type=user_file,
        metavar="JSON",
        help="report to write: overall and per-source means, per-example scores and pairs",
    )
    p.add_argument(
        "--encoder",
        default=PACKAGED_MINILM,
        type=user_path,
        help=f"sentence encoder: hub id, local folder, {PACKAGED_MINILM!r} (default; the paper used "
        f"{PAPER_ENCODER!r}), or {EXACT!r} (equal normalised strings match)",
    )
    p.add_argument(
        "--threshold",
        type=float,
        default=0.35,
        help="minimum cosine similarity for two steps to match, inclusive (tau; default 0.35)",
    )
    p.add_argument(
        "--alpha",
        type=float,
        default=0.3,
        help="weight of the order term in Ordered Match F1, in [0, 1] (default 0.3)",
    )
    p.add_argument(
        "--matcher",
        choices=("greedy", "dp"),
        default="greedy",
        help="greedy 1:1 matching in descending similarity (the paper; default) or dp, the order-preserving alignment",
    )
    p.add_argument(
        "--step_gate",
        choices=("none", "facts"),
        default="none",
        help="facts: steps whose numbers, operators or variables disagree never match (rewards/facts.py)",
    )
    p.add_argument("--device", default=None, help="encoder device (default: cuda when available, else cpu)")
    return p


def main(argv=None, *, scorer: MatchF1Scorer | None = None) -> int:
    """CLI entry point. ``scorer`` (tests, notebooks) lends its already loaded encoder."""
    args = build_parser().parse_args(argv)
    errors: list[str] = []
    for path in (args.predictions, args.data):
        if not path.is_file():
            errors.append(f"{path}: {'a folder, not a file' if path.is_dir() else 'file not found'}")
    if args.out.is_dir():
        errors.append(f"--out {args.out}: a folder; the report is one JSON file")
    elif args.out.exists() and args.out.resolve() in {args.predictions.resolve(), args.data.resolve()}:
        errors.append(
            f"--out {args.out} is an input of this scoring, which the report would replace; choose another --out"
        )
    if not errors:
        preds = read_jsonl(args.predictions, PRED_FIELDS, errors)
        data = read_jsonl(args.data, DATA_FIELDS, errors)
    if errors:
        for e in errors[:MAX_ERRORS]:
            print(f"error: {e}", file=sys.stderr)
        if len(errors) > MAX_ERRORS:
            print(f"error: ... and {len(errors) - MAX_ERRORS} more problem(s)", file=sys.stderr)
        print(f"error: {len(errors)} problem(s) in the input; nothing scored", file=sys.stderr)
        return 2
    for rows, path in ((preds, args.predictions), (data, args.data)):
        if not rows:
            print(f"error: {path} holds no rows; nothing scored", file=sys.stderr)
            return 2
    if not set(preds) & set(data):
        print(
            f"error: no prediction id of {args.predictions} is an id of {args.data} (e.g. "
            f"{clean_text(', '.join(list(preds)[:3]))} vs {clean_text(', '.join(list(data)[:3]))}); nothing scored",
            file=sys.stderr,
        )
        return 2
    missing = [data[i]["id"] for i in data if i not in preds]
    unknown = [preds[i]["id"] for i in preds if i not in data]
    for ids, what in (
        (missing, f"example(s) in {args.data} have no prediction (not scored)"),
        (unknown, f"prediction(s) in {args.predictions} have ids not in the data (ignored)"),
    ):
        if ids:
            shown = clean_text(", ".join(map(str, ids[:10])) + (" ..." if len(ids) > 10 else ""))
            print(f"warning: {len(ids)} {what}: {shown}", file=sys.stderr)
    lent = scorer is not None
    try:  # the reward modules' evaluation (score()); answer_only is the one without guard or weights
        lent_encoder = EXACT if lent and scorer.exact else (scorer.model if lent else args.encoder)
        module = AnswerOnlyReward(
            encoder=lent_encoder,
            threshold=args.threshold,
            order_alpha=args.alpha,
            device=args.device,
            matcher=args.matcher,
            step_gate=args.step_gate,
            score_steps=True,
        )
    except (EncoderLoadError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    ids = [i for i in data if i in preds]
    predicted = [ParsedOutput(list(preds[i]["reasoning_steps"]), None, True) for i in ids]
    s = module.score(predicted, [data[i] for i in ids], with_steps=True)
    assert s.steps is not None and s.step_rows == list(range(len(ids)))  # every data row has references
    examples = []
    for b, i in enumerate(ids):
        ex = {"id": data[i]["id"], "source": data[i].get("source")}
        ex.update({k: getattr(s.steps, k)[b].item() for k in (*METRICS, "n_pred", "n_ref", "n_matched")})
        ex.update(best_reference=s.steps.best_reference[b].item(), pairs=s.steps.pairs[b].tolist())
        examples.append(ex)
    by_source: dict[str, list[dict]] = defaultdict(list)
    for ex in examples:
        by_source[ex["source"] or "(no source)"].append(ex)
    rows = {"all": _summary(examples)}
    if any(ex["source"] for ex in examples):
        rows.update({src: _summary(exs) for src, exs in sorted(by_source.items())})
    print(format_table(rows))
    report = {
        "overall": rows["all"],
        "per_source": {k: v for k, v in rows.items() if k != "all"},
        "examples": examples,
        "missing_predictions": missing,
        "unknown_predictions": unknown,
        "settings": {
            "predictions": str(args.predictions),
            "data": str(args.data),
            "encoder": args.encoder,
            "encoder_preloaded": lent,
            "threshold": args.threshold,
            "alpha": args.alpha,
            "matcher": args.matcher,
            "step_gate": args.step_gate,
            "device": str(module.scorer.device),
        },
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    print(f"wrote {args.out} ({len(examples)} scored, {len(missing)} missing, {len(unknown)} unknown)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

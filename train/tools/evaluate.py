"""Evaluate a checkpoint, or a predictions file, on a data set with the trainer's own scorer.

Generation is :mod:`crystal_grpo.train.models.generation` (the validation callback's code), rows are
read and checked by :mod:`crystal_grpo.train.data.splits` (the same ``file:line`` errors as
training), scoring is :meth:`RewardModule.score` (the one evaluation). Completions are
appended to ``predictions.jsonl`` chunk by chunk, so an interrupted evaluation continues
where it stopped; several processes split the pending rows and the main process writes
them in the data's order. Scoring and the report come once every row has its completions.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from crystal_grpo.distributed import barrier, rank_and_world
from crystal_grpo.errors import CrystalError, some_of, traceback_if_asked
from crystal_grpo.jsonl import atomic_write_text
from crystal_grpo.metrics import per_completion
from crystal_grpo.paths import user_file, user_path
from crystal_grpo.rewards import build_reward
from crystal_grpo.rewards.alignment_view import ViewRow, alignment_rows, question_text, thumbnail, write_page
from crystal_grpo.rewards.base import RewardModule
from crystal_grpo.rewards.step_credit import StepCreditConfig
from crystal_grpo.train.models.generation import Sampling
from crystal_grpo.train.models.loading import from_pretrained_kwargs, recorded_model
from crystal_grpo.train.models.predictions import (
    PREDICTIONS,
    Backend,
    as_completion,
    check_ids,
    choose_backend,
    default_device,
    generate_predictions,
    generate_with_vllm,
    read_predictions,
)
from crystal_grpo.train.models.vision import VisionSection
from crystal_grpo.train.run.layout import CONFIG, read_config, run_targets
from crystal_grpo.typed import from_dict, to_dict

REPORT = "report.json"
#: The per-example format of the scorer CLI (``crystal-grpo-score``) and of CRYSTAL's
#: ``crystal-metrics`` tool: one ``{"id", "reasoning_steps", "answer"}`` object a line.
CRYSTAL_METRICS = "crystal_metrics_predictions.jsonl"
#: The inputs of the authors' own CLI (``crystal-metrics evaluate PREDICTIONS REFERENCES``): one
#: JSON object each, keyed by row id (its ``cli.py``): the first sample of each row, the references.
CRYSTAL_CLI = ("crystal_metrics/predictions.json", "crystal_metrics/references.json")
#: The alignment viewer: each completion's steps against the references (rewards/alignment_view.py).
STEPS_PAGE = "steps.html"
#: What an evaluation writes in its folder; the first is its marker, written before anything else.
IDENTITY = "evaluation.json"
#: The most bootstrap resamples asked for: a 95% interval's percentiles settle long before; more only takes time.
MAX_BOOTSTRAP = 100_000
WRITES = (IDENTITY, PREDICTIONS, REPORT, "report.md", "report.png", STEPS_PAGE, CRYSTAL_METRICS, *CRYSTAL_CLI)


class EvalError(CrystalError, ValueError):
    """Bad input for an evaluation (not a model, ids that do not match the data, ...)."""


@dataclass
class EvalSetup:
    """What an evaluation scores with: the run's reward, prompt and data, when there is a run."""

    reward: str = "cpr"
    reward_params: dict[str, Any] = field(default_factory=dict)
    step_credit: dict[str, Any] = field(default_factory=dict)  # reward.step_credit of the run: the viewer shows it
    system_prompt: str | None = None
    data: str | None = None
    data_split: str = "validation"  # of data, when it names a dataset with splits
    columns: dict[str, str] = field(default_factory=dict)  # data.columns of the run
    dtype: str | None = None
    trust_remote_code: bool = False
    model_kwargs: dict[str, Any] = field(default_factory=dict)  # the run's from_pretrained settings
    vision: VisionSection = field(default_factory=VisionSection)  # the run's image resolution (model.vision)
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)  # data.chat_template_kwargs of the run
    max_new_tokens: int = 256
    run_config: str | None = None  # the config.json this came from

    @classmethod
    def from_run_config(cls, path: Path) -> EvalSetup:
        return cls.from_config_dict(json.loads(path.read_text()), str(path))

    @classmethod
    def from_config_dict(cls, cfg: dict, where: str | None = None) -> EvalSetup:
        """From a resolved run config (a phase's ``config.json``, or a loaded YAML config)."""
        data, model, reward = cfg.get("data") or {}, cfg.get("model") or {}, cfg.get("reward") or {}
        section = recorded_model(model)
        return cls(
            reward=reward.get("name", "cpr"),
            reward_params=dict(reward.get("params") or {}),
            step_credit=dict(reward.get("step_credit") or {}),
            system_prompt=data.get("system_prompt"),
            data=data.get("validation"),
            data_split=data.get("validation_split") or "validation",
            columns=dict(data.get("columns") or {}),
            dtype=model.get("dtype"),
            trust_remote_code=bool(model.get("trust_remote_code")),
            model_kwargs=from_pretrained_kwargs(section),
            vision=section.vision,
            chat_template_kwargs=dict(data.get("chat_template_kwargs") or {}),
            max_new_tokens=int((cfg.get("validation") or {}).get("max_new_tokens") or 256),
            run_config=where,
        )


def find_run_config(checkpoint: str | Path) -> Path | None:
    """The run config of the phase a checkpoint belongs to (its folder or the one above; a
    model's own ``config.json`` has no ``trainer`` key)."""
    for folder in (Path(checkpoint), Path(checkpoint).parent):
        cfg = read_config(folder)
        if isinstance(cfg, dict) and "trainer" in cfg:
            return folder / CONFIG
    return None


# --------------------------------------------------------------------------------- scoring
def score_predictions(
    module: RewardModule, rows: Sequence[dict], predictions: Sequence[dict], thumbnails: dict[str, str] | None = None
) -> tuple[list[dict], list[ViewRow]]:
    """Per-example results (one per prediction, in the data's order, then by sample): what
    the completion says, the metrics, the reward of ``module`` and the matched step pairs; and
    the same completions as the alignment viewer's rows (``thumbnails``: a data URI by row id)."""
    by_id = {r["id"]: r for r in rows}
    order = {r["id"]: n for n, r in enumerate(rows)}
    preds = sorted(predictions, key=lambda p: (order[p["id"]], p["sample"]))
    data_rows = [by_id[p["id"]] for p in preds]
    completions = [as_completion(p) for p in preds]
    scored = module.score(completions, data_rows, with_steps=True)
    view_rows = [{**r, "image": (thumbnails or {}).get(r["id"])} for r in data_rows]
    view = alignment_rows(module, scored, view_rows, completions, [p["sample"] for p in preds])
    b = scored.batch
    values = module.per_row(b)
    pairs: dict[int, tuple[list, int]] = {}
    if scored.steps is not None:
        for n, i in enumerate(scored.step_rows):
            best = scored.steps.best_reference
            pairs[i] = (scored.steps.pairs[n].tolist(), int(best[n]) if best is not None else 0)
    out = []
    for i, (p, parsed) in enumerate(zip(preds, scored.parsed)):
        num = lambda t: None if t is None or math.isnan(float(t[i])) else float(t[i])
        matched, chain = pairs.get(i, ([], None))
        out.append(
            {
                "id": p["id"],
                "sample": p["sample"],
                "completion": p.get("completion"),
                "reasoning_steps": parsed.steps,
                "answer": parsed.answer,
                **{m: num(values.get(m)) for m in per_completion()},
                "matched_pairs": matched,
                "reference_chain": chain,
            }
        )
    return out, view


def write_scored(out_dir: Path, scored: Sequence[dict], rows: Sequence[dict]) -> None:
    """``predictions.jsonl`` with the scores (atomically: the raw file is the resume state),
    the first sample of each row in the scorer CLI's line format, and the two files the
    authors' ``crystal-metrics evaluate`` reads (:data:`CRYSTAL_CLI`)."""
    lines = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in scored)
    atomic_write_text(out_dir / PREDICTIONS, lines)
    firsts = [r for r in scored if r["sample"] == 0]
    atomic_write_text(
        out_dir / CRYSTAL_METRICS,
        "".join(
            json.dumps(
                {"id": r["id"], "reasoning_steps": r["reasoning_steps"], "answer": r["answer"]}, ensure_ascii=False
            )
            + "\n"
            for r in firsts
        ),
    )
    by_id = {r["id"]: r for r in rows}
    predictions = {
        r["id"]: {
            "question": question_text(by_id[r["id"]]),
            "reasoning_steps": r["reasoning_steps"],
            "answer": r["answer"] or "",
        }
        for r in firsts
    }
    references = {
        r["id"]: {"reference_steps": list(r.get("reference_steps") or []), "answer": str(r["answer"])} for r in rows
    }
    (out_dir / CRYSTAL_CLI[0]).parent.mkdir(exist_ok=True)
    for name, data in zip(CRYSTAL_CLI, (predictions, references)):
        atomic_write_text(out_dir / name, json.dumps(data, ensure_ascii=False, indent=1))


# ------------------------------------------------------------------------------- one call
@dataclass
class EvalRequest:
    """One evaluation: a model or a predictions file, on a data file, into a folder."""

    data: str
    out: Path
    split: str = "test"  # of data, when it names a dataset with splits
    model: str | None = None
    predictions: str | None = None
    setup: EvalSetup = field(default_factory=EvalSetup)
    sampling: Sampling = field(default_factory=Sampling)
    batch_size: int = 8
    backend: Backend = "auto"
    max_samples: int | None = None
    bootstrap: int = 1000
    seed: int = 0
    force: bool = False
    skip_invalid: bool = False


def evaluate(req: EvalRequest) -> dict | None:
    """Generate what is missing, score, write the report; returns it (None on other ranks).

    A finished evaluation of the same model, data and sampling is not redone (``force``
    does); a different one in the same folder is refused rather than mixed in.
    """
    from crystal_grpo.train.data.splits import load_split, locate
    from crystal_grpo.train.tools.eval_report import build_report, write_report

    rank, world = rank_and_world()
    out = Path(req.out)
    identity = {
        "model": req.model,
        "predictions": req.predictions,
        "data": str(req.data),
        "sampling": vars(req.sampling),
        "reward": req.setup.reward,
        "reward_params": req.setup.reward_params,
        "max_samples": req.max_samples,
    }
    if locate(req.data).is_dir():  # a dataset with splits: which one is part of what was evaluated
        identity["split"] = req.split
    refused = out_problem(out, req.predictions, req.model)
    if refused:
        raise EvalError(refused)
    previous = _read_identity(out)
    if previous is not None and previous != identity and not _has_work(out):
        previous = None  # an attempt that failed before its first prediction blocks nothing
    if previous is not None and previous != identity and not req.force:
        raise EvalError(
            f"{out} holds an evaluation of something else ({_differs(previous, identity)}); "
            "choose another --out or pass --force to start it again"
        )
    report_path = out / REPORT
    if report_path.exists() and previous == identity and not req.force:
        if rank == 0:
            print(f"{out}: already evaluated (report.json); --force evaluates again")
        return json.loads(report_path.read_text()) if rank == 0 else None
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        if req.force:
            for name in (PREDICTIONS, REPORT, STEPS_PAGE, CRYSTAL_METRICS, *CRYSTAL_CLI):
                (out / name).unlink(missing_ok=True)
        atomic_write_text(out / IDENTITY, json.dumps(identity, indent=2))
    barrier()
    split = load_split(
        req.data,
        system_prompt=req.setup.system_prompt,
        skip_invalid=req.skip_invalid,
        split=req.split,
        columns=req.setup.columns,
        skip_option="--skip_invalid",
        unique_ids="completions are matched to their rows by id",
    )
    if split.skipped and rank == 0:
        print(f"skipped {split.skipped} invalid row(s) of {req.data} (--skip_invalid)")
    ds = split.dataset
    all_ids = list(ds["id"])
    if req.max_samples is not None:
        ds = ds.select(range(min(req.max_samples, len(ds))))
    rows = ds.with_format(None).remove_columns([c for c in ("images",) if c in ds.column_names]).to_list()
    if req.predictions is not None:
        predictions = read_predictions(Path(req.predictions))
        check_ids(predictions, all_ids, req.predictions, req.data, complete=False)
        keep = {r["id"] for r in rows}
        predictions = [p for p in predictions if p["id"] in keep]
        check_ids(predictions, [r["id"] for r in rows], req.predictions, req.data)
        seconds = 0.0
    else:
        start = time.perf_counter()
        backend = choose_backend(req.backend, world)
        if backend == "vllm":
            if rank == 0:
                generate_with_vllm(
                    req.model,
                    ds,
                    out,
                    req.sampling,
                    req.setup.dtype,
                    req.setup.trust_remote_code,
                    req.setup.chat_template_kwargs,
                )
        else:
            from transformers import set_seed

            from crystal_grpo.train.models.loading import load_checkpoint

            set_seed(req.seed + rank)  # sampled completions are reproducible
            from crystal_grpo.train.models.generation import Engine

            model, processing = load_checkpoint(
                req.model,
                dtype=req.setup.dtype,
                trust_remote_code=req.setup.trust_remote_code,
                device=default_device(),
                model_kwargs=req.setup.model_kwargs,
                vision=req.setup.vision,
            )
            generate_predictions(
                model,
                processing,
                ds,
                out,
                req.sampling,
                req.batch_size,
                engine=Engine(chat_template_kwargs=req.setup.chat_template_kwargs),
            )
        seconds = time.perf_counter() - start
        barrier()
        if rank != 0:
            return None
        predictions = read_predictions(out / PREDICTIONS)
        check_ids(predictions, [r["id"] for r in rows], str(out / PREDICTIONS), req.data)
    if rank != 0:
        return None
    credit = from_dict(StepCreditConfig, req.setup.step_credit, "reward.step_credit")
    module = build_reward(req.setup.reward, step_credit=credit, **req.setup.reward_params)
    thumbnails = (
        {r["id"]: thumbnail(ds[i]["images"]) for i, r in enumerate(rows)} if "images" in ds.column_names else {}
    )
    scored, view = score_predictions(module, rows, predictions, thumbnails)
    write_scored(out, scored, rows)
    cfg = module.config
    write_page(out / STEPS_PAGE, view, cfg.threshold, f"{req.model or req.predictions} on {req.data}", cfg.matcher)
    report = build_report(rows, scored, identity, bootstrap=req.bootstrap, seed=req.seed)
    report["generation_seconds"] = seconds
    write_report(out, report)
    return report


def out_problem(out: Path, predictions: str | None, model: str | None = None) -> str | None:
    """Why an evaluation may not write into ``out``, or None: it writes only into a new or empty
    folder or one holding an evaluation (its :data:`IDENTITY` marker), never over the
    ``--predictions`` file it reads (``--force`` would delete that before reading it), and never
    inside the model folder it scores: a run removes its checkpoints and ``final/`` whole (rotation,
    ``--overwrite_output_dir``), and the evaluation with them."""
    holds = model is not None and any((Path(model) / f).is_file() for f in ("config.json", "adapter_config.json"))
    if holds and Path(out).resolve().is_relative_to(Path(model).resolve()):
        return f"--out {out} is inside the model folder {model}, which its run may remove whole: choose another --out"
    inputs = {(out / name).resolve() for name in WRITES}
    if predictions is not None and Path(predictions).resolve() in inputs:
        return (
            f"--predictions {predictions} is a file the evaluation writes into --out {out}, so it would be "
            "replaced by the scored predictions: choose another --out"
        )
    if not out.is_dir() or (out / IDENTITY).is_file():
        return None
    held = sorted(p.name + ("/" if p.is_dir() and not p.is_symlink() else "") for p in out.iterdir())
    if not held:
        return None
    return (
        f"--out {out} holds {some_of(held)} but no evaluation ({IDENTITY}): an evaluation writes only into a new "
        "or empty folder or its own, so nothing here is touched; choose another --out"
    )


def _read_identity(out: Path) -> dict | None:
    path = out / IDENTITY
    try:
        return json.loads(path.read_text()) if path.exists() else None
    except ValueError:
        return None


def _has_work(out: Path) -> bool:
    return any((out / name).is_file() and (out / name).stat().st_size > 0 for name in (PREDICTIONS, REPORT))


def _differs(a: dict, b: dict) -> str:
    keys = [k for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]
    return ", ".join(f"{k}: {a.get(k)!r} there, {b.get(k)!r} now" for k in keys[:3])


# ------------------------------------------------------------------------------------ CLI
def build_parser():
    import argparse

    ap = argparse.ArgumentParser(
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Score a checkpoint (or a predictions file) on a data set with the trainer's scorer.",
        epilog="examples:\n"
        "  python scripts/evaluate.py --model runs/cpr/final --data data/wordproblems/val.jsonl --out eval/cpr\n"
        "  python scripts/evaluate.py --run runs/demo                      # every phase's best checkpoint\n"
        "  python scripts/evaluate.py --predictions eval/cpr/predictions.jsonl --data ... --out ...\n"
        "  python scripts/evaluate.py --compare eval/a eval/b\n"
        "  accelerate launch scripts/evaluate.py --model ... --data ... --out ...   # rows split over processes",
    )
    what = ap.add_mutually_exclusive_group(required=True)
    what.add_argument(
        "--model", type=user_path, help="a model folder: a run's checkpoint-N/ or final/, or any HF model folder"
    )
    what.add_argument("--run", type=user_path, help="a run folder: evaluates every phase's best checkpoint")
    what.add_argument(
        "--predictions",
        type=user_path,
        help="score these completions instead of generating (JSONL: id and "
        "completion, or id, reasoning_steps and answer)",
    )
    what.add_argument(
        "--compare",
        nargs="+",
        metavar="EVAL_DIR[,EVAL_DIR...]",
        help="side by side: finished "
        "evaluation folders of the same rows, with paired differences from the first; comma-separated "
        "folders are one arm's training seeds (intervals then resample seeds, then rows)",
    )
    ap.add_argument(
        "--data",
        type=user_path,
        help="JSONL data (docs/method.md section 1), e.g. a held-out test set; default: the "
        "run's validation data, which chose its best checkpoint",
    )
    ap.add_argument(
        "--split",
        help="split of a dataset folder or Hub dataset given as --data (default: test; "
        "with the run's own validation data, its data.validation_split)",
    )
    ap.add_argument("--out", type=user_path, help="output folder (default with --run: RUN/eval/PHASE)")
    ap.add_argument(
        "--config",
        type=user_path,
        help="a run config (name or path) whose reward and system prompt to use; default: "
        "the run config next to the checkpoint, else the cpr reward",
    )
    ap.add_argument("--reward", help="reward whose value is reported (default: the run's)")
    ap.add_argument("--num_samples", type=int, default=1, help="completions per row (pass@k with k > 1)")
    ap.add_argument("--temperature", type=float, default=0.0, help="0: greedy (default, the paper's)")
    ap.add_argument("--top_p", type=float, default=1.0)
    ap.add_argument("--max_new_tokens", type=int, help="default: the run's validation.max_new_tokens, else 256")
    ap.add_argument("--batch_size", type=int, default=8, help="prompts per generate call and process")
    ap.add_argument(
        "--backend",
        choices=["auto", "hf", "vllm"],
        default="auto",
        help="auto: vLLM when installed and on a GPU (one process), else transformers",
    )
    ap.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], help="default: the run's model.dtype")
    ap.add_argument("--max_samples", type=int, help="only the first N data rows")
    ap.add_argument("--bootstrap", type=int, default=1000, help="bootstrap resamples for the 95%% intervals")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--force", action="store_true", help="evaluate again even if the folder holds a finished one")
    ap.add_argument("--skip_invalid", action="store_true", help="drop (and count) bad data rows instead of stopping")
    return ap


def _setup(args, checkpoint: str | None, run_config: Path | None) -> EvalSetup:
    if args.config:
        from crystal_grpo.train.config.run_config import load_config

        setup = EvalSetup.from_config_dict(to_dict(load_config(args.config)[0]), args.config)
    else:
        found = run_config or (find_run_config(checkpoint) if checkpoint else None)
        setup = EvalSetup.from_run_config(found) if found else EvalSetup()
    if args.reward:
        setup.reward, setup.reward_params = (
            args.reward,
            {k: v for k, v in setup.reward_params.items() if k in ("encoder", "device", "threshold", "step_gate")},
        )
    if args.dtype:
        setup.dtype = args.dtype
    if args.max_new_tokens:
        setup.max_new_tokens = args.max_new_tokens
    return setup


def _check_numbers(args) -> None:
    for key, low in (
        ("num_samples", 1),
        ("batch_size", 1),
        ("max_new_tokens", 1),
        ("max_samples", 1),
        ("bootstrap", 0),
    ):
        v = getattr(args, key)
        if v is not None and v < low:
            raise EvalError(f"--{key} {v}: expected an integer >= {low}")
    if args.bootstrap > MAX_BOOTSTRAP:
        raise EvalError(f"--bootstrap {args.bootstrap}: expected an integer from 0 to {MAX_BOOTSTRAP}")
    if args.num_samples > 1 and args.temperature <= 0:
        raise EvalError(
            f"--num_samples {args.num_samples} with greedy decoding gives identical samples: set --temperature > 0"
        )


def main(argv: Sequence[str] | None = None) -> int:
    from crystal_grpo.train.tools.eval_report import compare, compare_markdown

    args = build_parser().parse_args(argv)
    try:
        _check_numbers(args)
        if args.compare:
            arms = [[user_file(f) for f in arm.split(",")] for arm in args.compare]  # a,b,c: one arm's seeds
            print(compare_markdown(compare(arms, args.bootstrap, args.seed)), end="")
            return 0
        _init_distributed()
        if args.run:
            run_dir = Path(args.run)
            targets = run_targets(run_dir)
            base = Path(args.out) if args.out else run_dir / "eval"
            jobs = [(str(ckpt), base / name, cfg) for name, ckpt, cfg in targets]
        else:
            if not args.out:
                raise EvalError("--out is required with --model and --predictions")
            jobs = [(args.model, Path(args.out), None)]
        folders = []
        for model, out, cfg in jobs:
            setup = _setup(args, model, cfg)
            data = args.data or setup.data
            if not data:
                raise EvalError("--data is required (the run config names no validation data)")
            if not args.data and rank_and_world()[0] == 0:
                print(
                    f"{model or args.predictions}: scored on {data}, the run's validation data, which chose its "
                    "best checkpoint: not a held-out estimate; --data FILE scores a test set"
                )
            sampling = Sampling(setup.max_new_tokens, args.temperature, args.top_p, args.num_samples)
            split = args.split or (setup.data_split if not args.data else "test")
            req = EvalRequest(
                data=data,
                out=out,
                split=split,
                model=model if not args.predictions else None,
                predictions=args.predictions,
                setup=setup,
                sampling=sampling,
                batch_size=args.batch_size,
                backend=args.backend,
                max_samples=args.max_samples,
                bootstrap=args.bootstrap,
                seed=args.seed,
                force=args.force,
                skip_invalid=args.skip_invalid,
            )
            report = evaluate(req)
            folders.append(out)
            if report is not None:
                from crystal_grpo.train.tools.eval_report import markdown

                print(markdown(report).split("\n## ")[0].rstrip() + f"\n\n(full report: {out / 'report.md'})\n")
        if len(folders) > 1 and rank_and_world()[0] == 0:
            print(compare_markdown(compare(folders, args.bootstrap, args.seed)), end="")
        return 0
    except (CrystalError, ValueError, OSError) as err:
        traceback_if_asked(err)
        print(f"error: {err}", file=sys.stderr)
        return 2


def _init_distributed() -> None:
    """Under ``accelerate launch``/``torchrun``: a process group (gloo without a GPU)."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        import torch
        from accelerate import PartialState

        cuda = torch.cuda.is_available()
        PartialState(cpu=not cuda, backend=None if cuda else "gloo")


if __name__ == "__main__":
    sys.exit(main())

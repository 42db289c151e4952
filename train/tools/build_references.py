"""Reference steps for a data set that has none: ``scripts/build_references.py`` (docs/references.md).

CPR scores steps against ``reference_steps``; question/answer data rarely has them. This builds
them the CRYSTAL way (Sec. 3.1, docs/method.md section 11): several generators each write
``samples`` solutions a row (or trajectory files written elsewhere are read); solutions with a
wrong answer are dropped; :mod:`crystal_grpo.rewards.references` turns the rest into one chain.
Everything is resumable (each generator's completions and the output are written row by row, so
a rerun skips what is written), and a row that fails is reported with its id.
"""

from __future__ import annotations

import hashlib
import json
import re
import statistics
import sys
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from crystal_grpo.errors import CrystalError
from crystal_grpo.jsonl import Unreadable, atomic_write_text, iter_jsonl, read_json
from crystal_grpo.paths import user_file, user_path
from crystal_grpo.rewards.answers import answers_match
from crystal_grpo.rewards.encoder import PACKAGED_MINILM
from crystal_grpo.rewards.parsing import ParsedOutput, parse_completion
from crystal_grpo.train.models.generation import Sampling
from crystal_grpo.train.models.predictions import (
    PREDICTIONS,
    as_completion,
    choose_backend,
    default_device,
    drop_partial,
    generate_predictions,
    generate_with_vllm,
    read_predictions,
)

if TYPE_CHECKING:  # torch: loaded by a build, not by --help
    from crystal_grpo.rewards.match_f1 import MatchF1Scorer
    from crystal_grpo.rewards.references import BuiltChain


class BuildError(CrystalError, ValueError):
    """A build that cannot go on; the message says what to change."""


SETTINGS = "build.json"
GENERATION = "generation.json"


@dataclass
class BuildRequest:
    """One build: input rows, where the trajectories come from, and how they are aggregated."""

    data: str
    out: Path
    generators: list[str] = field(default_factory=list)
    trajectories: list[str] = field(default_factory=list)
    work_dir: Path | None = None  # default: <out without .jsonl>.work/
    sampling: Sampling = field(default_factory=lambda: Sampling(256, 0.9, 1.0, 4))
    batch_size: int = 8
    backend: str = "auto"
    dtype: str | None = None
    system_prompt: str | None = None
    encoder: str = PACKAGED_MINILM
    cluster_threshold: float | None = None  # None: the encoder's measured default
    match_threshold: float = 0.35  # Match F1's tau, for the check against existing references
    min_support: int = 2
    keep_incorrect: bool = False
    reference_sets: bool = False
    rebuild: bool = False
    keep_collapsed: bool = False
    max_rows: int | None = None
    device: str | None = None
    seed: int = 0
    progress: bool = True

    @property
    def folder(self) -> Path:
        out = Path(self.out)
        return Path(self.work_dir) if self.work_dir else out.with_name(out.name.removesuffix(".jsonl") + ".work")


@dataclass
class RowResult:
    """What became of one row: ``status`` is built, kept, no_correct, no_consensus or collapsed."""

    id: str
    status: str
    row: dict | None = None  # what is written (None: nothing)
    chain: BuiltChain | None = None
    disagreed: bool = False
    f1_vs_original: float | None = None  # the built chain against the row's own references
    f1_trajectories: float | None = None  # the accepted trajectories against them, on average


# ------------------------------------------------------------------------------ input
def read_rows(req: BuildRequest) -> tuple[list[dict], Any]:
    """The raw rows (written back with their references) and the checked data set (prompts,
    images) from the training loader; a row without ``id`` gets the loader's ``file:line``."""
    from crystal_grpo.train.data.splits import load_split, locate
    from crystal_grpo.train.data.splits import read_rows as source_rows

    ds = load_split(
        req.data, system_prompt=req.system_prompt, limit=req.max_rows, require_references=False, skip_option=None
    ).dataset
    path = Path(req.data)
    raw = [
        ({"id": f"{path.name}:{no}", **row} if "id" not in row else row)
        for no, row in source_rows(locate(req.data))
        if not isinstance(row, Unreadable)
    ][: len(ds)]
    seen: Counter = Counter(str(r["id"]) for r in raw)
    dupes = [i for i, n in seen.items() if n > 1]
    if dupes:
        raise BuildError(f"{path}: {len(dupes)} duplicate id(s) (e.g. {', '.join(dupes[:3])}): ids must be unique")
    return raw, ds


def generator_folder(root: Path, name: str) -> Path:
    """One folder per generator, named after it, with a hash so two models called ``final`` differ."""
    slug = re.sub(r"[^A-Za-z0-9._-]+", "_", Path(name.rstrip("/")).name or name)[:40]
    return root / f"{slug}-{hashlib.sha1(name.encode()).hexdigest()[:8]}"


def generate_trajectories(req: BuildRequest, name: str, ds, folder: Path) -> None:
    """``samples`` completions a row from one generator into ``folder/predictions.jsonl``
    (resumable: rows already there are not generated again)."""
    identity = {
        "generator": name,
        "data": str(Path(req.data).resolve()),
        "system_prompt": req.system_prompt,
        "sampling": asdict(req.sampling),
    }
    _check_identity(folder / GENERATION, identity, "--work_dir")
    if choose_backend(req.backend, 1) == "vllm":
        generate_with_vllm(name, ds, folder, req.sampling, req.dtype)
        return
    from transformers import set_seed

    from crystal_grpo.train.models.loading import ModelSection, load_checkpoint, load_policy

    set_seed(req.seed)
    if Path(name).is_dir():
        model, processing = load_checkpoint(name, dtype=req.dtype, device=default_device())
    else:  # a hub id: from the local cache when offline
        model, processing = load_policy(ModelSection(name_or_path=name, dtype=req.dtype or "float32"))
        model = model.to(default_device()).eval()
    generate_predictions(model, processing, ds, folder, req.sampling, req.batch_size, progress=req.progress)


def read_trajectories(path: Path, ids: set[str]) -> dict[str, list[ParsedOutput]]:
    """A trajectory file's solutions by row id: the predictions format (``id``, ``reasoning_steps``,
    ``answer``) or the evaluation's (``id``, ``completion``, parsed as in training); any
    number of lines an id. Ids not in the data are left out."""
    out: dict[str, list[ParsedOutput]] = {}
    for pred in read_predictions(path, unique=False):
        if pred["id"] in ids:
            parsed = as_completion(pred)
            out.setdefault(pred["id"], []).append(parse_completion(parsed) if isinstance(parsed, str) else parsed)
    return out


# -------------------------------------------------------------------------------- rows
def accepted(solutions: Sequence[ParsedOutput], truth: Any, choices: Any, keep_incorrect: bool) -> list[list[str]]:
    """The step lists of the solutions that count: with steps, and (unless ``keep_incorrect``)
    an answer that matches the row's, by the training reward's answer check."""
    out = []
    for s in solutions:
        if not s.steps:
            continue
        try:
            ok = keep_incorrect or answers_match(s.answer, truth, list(choices) if choices else None)
        except Exception:  # noqa: BLE001 - a judge that fails rejects the answer
            ok = False
        if ok:
            out.append(list(s.steps))
    return out


def build_row(
    raw: dict,
    record: dict,
    by_generator: dict[str, list[ParsedOutput]],
    scorer: MatchF1Scorer,
    req: BuildRequest,
    threshold: float,
) -> RowResult:
    """The output row for one input row (or why there is none)."""
    from crystal_grpo.rewards.references import Trajectory, build_chain

    rid = str(raw["id"])
    trajectories = [
        Trajectory(steps, gen)
        for gen, sols in by_generator.items()
        for steps in accepted(sols, record["answer"], record.get("choices"), req.keep_incorrect)
    ]
    if not trajectories:
        return RowResult(rid, "no_correct")
    chain = build_chain(scorer, trajectories, threshold, req.min_support)
    n_gen = len({t.generator for t in trajectories})
    everything = chain.clusters + chain.dropped
    disagreed = not any((len(c.generators) if n_gen > 1 else c.support) >= 2 for c in everything)
    result = RowResult(rid, "built", chain=chain, disagreed=disagreed)
    if not chain.steps:
        result.status = "no_consensus"
        return result
    original = list(raw.get("reference_steps") or [])
    if original:  # --rebuild: how close the chain, and a single solution, come to the row's own
        f1 = scorer.score([chain.steps] + [t.steps for t in trajectories], [original] * (1 + len(trajectories))).f1
        result.f1_vs_original, result.f1_trajectories = float(f1[0]), float(f1[1:].mean())
    if chain.collapse and not req.keep_collapsed:
        result.status = "collapsed"
        return result
    out = {k: v for k, v in raw.items() if k not in ("reference_steps", "reference_sets")}
    out["reference_steps"] = chain.steps
    if req.reference_sets:
        out["reference_sets"] = [t.steps for t in trajectories if t.steps != chain.steps]
    out["reference_build"] = {
        "generators": list(by_generator),
        "trajectories": sum(map(len, by_generator.values())),
        "accepted": len(trajectories),
        "threshold": threshold,
        "min_support": req.min_support,
        "steps": [
            {
                "text": c.text,
                "generators": c.generators,
                "support": c.support,
                "cluster_size": len(c.members),
                "position": round(c.position, 4),
            }
            for c in chain.clusters
        ],
        "dropped_cluster_sizes": [len(c.members) for c in chain.dropped],
        "warnings": chain.collapse
        + chain.warnings
        + (["the generators disagreed on every step"] if disagreed else []),
        **(
            {
                "original_steps": original,
                "match_f1_vs_original": result.f1_vs_original,
                "trajectories_match_f1_vs_original": result.f1_trajectories,
            }
            if original
            else {}
        ),
    }
    result.row = out
    return result


# ------------------------------------------------------------------------------ output
def written_ids(path: Path) -> set[str]:
    """Ids already in the output (a last line cut off by a kill is dropped first)."""
    if not path.exists():
        return set()
    drop_partial(path, 1)
    out = set()
    for no, row in iter_jsonl(path):
        if isinstance(row, Unreadable) or not isinstance(row, dict) or "id" not in row:
            raise BuildError(f"{path}:{no}: not a row this build wrote; choose another --out")
        out.add(str(row["id"]))
    return out


def _check_identity(path: Path, identity: dict, what: str) -> None:
    """Refuse to mix two different builds (or generations) in one place."""
    previous = read_json(path)
    if (
        previous is not None
        and previous != identity
        and not any(p.is_file() and p.name not in (SETTINGS, GENERATION) for p in path.parent.rglob("*"))
    ):
        previous = None  # an attempt that failed before any work blocks nothing
    if previous is not None:
        if previous != identity:
            keys = [k for k in identity if previous.get(k) != identity[k]]
            raise BuildError(
                f"{path.parent} holds a build with other settings ({', '.join(keys)}); "
                f"choose another {what} or delete it"
            )
    else:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(path, json.dumps(identity, indent=2))


def build(req: BuildRequest) -> dict:
    """Run one build (see the module docstring); returns the summary it prints."""
    if not req.generators and not req.trajectories:
        raise BuildError("nothing to build from: give --generator MODEL or --trajectories FILE (or both)")
    from crystal_grpo.rewards.match_f1 import MatchF1Scorer
    from crystal_grpo.rewards.references import PAPER_CLUSTER_THRESHOLD, default_threshold

    threshold = req.cluster_threshold if req.cluster_threshold is not None else default_threshold(req.encoder)
    notes = []
    if threshold is None:
        threshold = PAPER_CLUSTER_THRESHOLD
        notes.append(
            f"no measured --cluster_threshold for encoder {req.encoder!r}: using the paper's "
            f"{threshold}; watch the collapse warnings and measure one (docs/references.md)"
        )
    out, folder = Path(req.out), req.folder
    inputs = [("--data", req.data), *(("--trajectories", t) for t in req.trajectories)]
    same = [flag for flag, path in inputs if Path(path).resolve() == out.resolve()]
    if same:  # (built rows are appended to --out: into its own input, every row looks "already written")
        raise BuildError(
            f"--out {out} is also the {same[0]} file: the build appends its rows to --out; choose another --out"
        )
    raw, ds = read_rows(req)  # bad data stops the build before it claims a folder
    _check_identity(
        folder / SETTINGS,
        {
            "data": str(Path(req.data).resolve()),
            "generators": req.generators,
            "trajectories": req.trajectories,
            "sampling": asdict(req.sampling),
            "encoder": req.encoder,
            "cluster_threshold": threshold,
            "min_support": req.min_support,
            "keep_incorrect": req.keep_incorrect,
            "reference_sets": req.reference_sets,
            "rebuild": req.rebuild,
            "keep_collapsed": req.keep_collapsed,
        },
        "--out (or --work_dir)",
    )
    records = ds.with_format(None)  # answers and choices; images stay unopened
    done = written_ids(out)
    todo = [i for i, r in enumerate(raw) if str(r["id"]) not in done]
    to_build = [i for i in todo if req.rebuild or not raw[i].get("reference_steps")]
    ids = {str(raw[i]["id"]) for i in to_build}  # the rows that need solutions
    sources: dict[str, dict[str, list[ParsedOutput]]] = {}
    for name in req.generators:
        gen_folder = generator_folder(folder, name)
        if to_build:
            generate_trajectories(req, name, ds.select(to_build), gen_folder)
        sources[name] = read_trajectories(gen_folder / PREDICTIONS, ids) if to_build else {}
    for path in req.trajectories:
        sources[path] = read_trajectories(Path(path), ids)
        if to_build and not sources[path]:
            notes.append(f"{path}: no trajectory for any row being built")
    scorer = MatchF1Scorer(req.encoder, threshold=req.match_threshold, device=req.device)
    results, failed = [], []
    out.parent.mkdir(parents=True, exist_ok=True)
    from tqdm.auto import tqdm

    with open(out, "a", encoding="utf-8") as fh:
        for i in tqdm(todo, unit="row", desc="building", disable=not req.progress or not todo):
            rid = str(raw[i]["id"])
            try:
                if rid in ids:
                    sols = {name: got.get(rid, []) for name, got in sources.items()}
                    result = build_row(raw[i], records[i], sols, scorer, req, threshold)
                else:
                    result = RowResult(rid, "kept", row=raw[i])
            except Exception as err:  # noqa: BLE001 - one bad row must not stop the others
                failed.append(f"{rid}: {type(err).__name__}: {err}")
                continue
            results.append(result)
            if result.row is not None:
                fh.write(json.dumps(result.row, ensure_ascii=False) + "\n")
                fh.flush()
    summary = summarize(results, failed, len(done), out, threshold, notes)
    atomic_write_text(folder / "summary.json", json.dumps(summary, indent=2))
    print(format_summary(summary))
    return summary


# ----------------------------------------------------------------------------- summary
def summarize(
    results: Sequence[RowResult],
    failed: Sequence[str],
    resumed: int,
    out: Path,
    threshold: float,
    notes: Sequence[str],
) -> dict:
    """Counts by status, reference lengths over the whole output, the ids to look at."""
    by = lambda status: [r.id for r in results if r.status == status]
    lengths = [len(row.get("reference_steps") or []) for _, row in iter_jsonl(out) if isinstance(row, dict)]
    built = [r for r in results if r.status == "built"]
    compared = [r for r in built if r.f1_vs_original is not None]
    return {
        "out": str(out),
        "threshold": threshold,
        "already_written": resumed,
        "built": len(built),
        "kept": len(by("kept")),
        "no_correct": by("no_correct"),
        "no_consensus": by("no_consensus"),
        "collapsed": {r.id: r.chain.collapse for r in results if r.status == "collapsed"},
        "collapse_warnings": {r.id: r.chain.collapse for r in built if r.chain.collapse},
        "short_chains": [r.id for r in built if r.chain.warnings],
        "disagreed": [r.id for r in results if r.disagreed],
        "failed": list(failed),
        "reference_lengths": dict(sorted(Counter(lengths).items())),
        "mean_reference_length": statistics.fmean(lengths) if lengths else None,
        "rows_vs_original": len(compared),
        "match_f1_vs_original": statistics.fmean(r.f1_vs_original for r in compared) if compared else None,
        "trajectories_match_f1_vs_original": (
            statistics.fmean(r.f1_trajectories for r in compared) if compared else None
        ),
        "notes": list(notes),
    }


def _ids(ids: Sequence[str]) -> str:
    return ", ".join(ids[:10]) + (" ..." if len(ids) > 10 else "")


def format_summary(s: dict) -> str:
    lines = [
        f"{s['out']}: {s['built']} row(s) built, {s['kept']} kept with their references, "
        f"{s['already_written']} already written (cluster threshold {s['threshold']})"
    ]
    for key, what in (
        ("no_correct", "skipped, no correct trajectory"),
        ("no_consensus", "skipped, no step reached --min_support trajectories"),
    ):
        if s[key]:
            lines.append(f"  {len(s[key])} {what}: {_ids(s[key])}")
    if s["collapsed"]:
        first = next(iter(s["collapsed"].items()))
        lines.append(
            f"  {len(s['collapsed'])} skipped as collapsed (raise --cluster_threshold, or "
            f"--keep_collapsed): {_ids(list(s['collapsed']))}; e.g. {first[0]}: {'; '.join(first[1])}"
        )
    for key, what in (
        ("collapse_warnings", "{n} written row(s) look collapsed"),
        ("short_chains", "{n} chain(s) far shorter than their trajectories (little consensus)"),
        ("disagreed", "on {n} row(s) every generator disagreed on every step"),
    ):
        if s[key]:
            lines.append(f"  warning: {what.format(n=len(s[key]))}: {_ids(list(s[key]))}")
    if s["failed"]:
        lines.append(f"  {len(s['failed'])} row(s) failed: " + "; ".join(s["failed"][:5]))
    if s["reference_lengths"]:
        hist = ", ".join(f"{k}: {v}" for k, v in s["reference_lengths"].items())
        lines.append(f"  reference steps per written row (mean {s['mean_reference_length']:.2f}): {hist}")
    if s["match_f1_vs_original"] is not None:
        lines.append(
            f"  Match F1 against the rows' existing references over {s['rows_vs_original']} built row(s): "
            f"{s['match_f1_vs_original']:.3f} for the built chains, "
            f"{s['trajectories_match_f1_vs_original']:.3f} for a single trajectory (mean)"
        )
    lines.extend(f"  note: {n}" for n in s["notes"])
    return "\n".join(lines)


def measure_threshold(data: str, encoder: str, device: str | None = None) -> dict:
    """How similar different reference steps of one row are with this encoder, and the tau_c
    that keeps 99% of them apart (what the shipped defaults were measured with)."""
    chains = [
        list(r["reference_steps"])
        for _, r in iter_jsonl(data)
        if isinstance(r, dict) and isinstance(r.get("reference_steps"), list) and len(r["reference_steps"]) > 1
    ]
    if not chains:
        raise BuildError(f"{data}: no row with two or more reference_steps to measure on")
    import torch

    from crystal_grpo.rewards.match_f1 import MatchF1Scorer
    from crystal_grpo.rewards.references import default_threshold, distinct_step_similarities, suggest_threshold

    sims = distinct_step_similarities(MatchF1Scorer(encoder, device=device), chains).double()
    levels = (0.5, 0.9, 0.95, 0.99)
    qs = dict(
        zip((f"p{round(q * 100)}" for q in levels), torch.quantile(sims, torch.tensor(levels).double()).tolist())
    )
    return {
        "data": data,
        "encoder": encoder,
        "rows": len(chains),
        "pairs": len(sims),
        **qs,
        "max": float(sims.max()),
        "suggested": suggest_threshold(sims),
        "default": default_threshold(encoder),
    }


# --------------------------------------------------------------------------------- CLI
def build_parser():
    import argparse

    ap = argparse.ArgumentParser(
        prog="build_references.py",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=(
            "Reference steps for question/answer data (CRYSTAL's Delphi-style consensus, docs/method.md section 11)."
        ),
        epilog="examples:\n"
        "  python scripts/build_references.py --data my.jsonl --out my_refs.jsonl \\\n"
        "      --generator Qwen/Qwen2.5-VL-7B-Instruct --generator ./other-model --samples 4\n"
        "  python scripts/build_references.py --data my.jsonl --out my_refs.jsonl --trajectories a.jsonl b.jsonl\n"
        "  python scripts/build_references.py --data with_refs.jsonl --measure_threshold",
    )
    ap.add_argument(
        "--data", required=True, type=user_path, help="JSONL rows with question (image/choices) and answer"
    )
    ap.add_argument("--out", type=user_file, help="JSONL to write (appended to: a rerun resumes)")
    ap.add_argument(
        "--generator",
        action="append",
        default=[],
        dest="generators",
        type=user_path,
        metavar="MODEL",
        help="a model folder or cached hub id that writes --samples solutions a row (repeatable)",
    )
    ap.add_argument(
        "--trajectories",
        nargs="+",
        default=[],
        type=user_path,
        metavar="JSONL",
        help="solutions written elsewhere, one generator a file: {id, reasoning_steps, answer} "
        "(or {id, completion}) lines, any number an id",
    )
    ap.add_argument("--samples", type=int, default=4, help="solutions per row and generator (default 4)")
    ap.add_argument("--temperature", type=float, default=0.9, help="sampling temperature (default 0.9)")
    ap.add_argument("--top_p", type=float, default=1.0)
    ap.add_argument("--max_new_tokens", type=int, default=256)
    ap.add_argument("--batch_size", type=int, default=8, help="prompts per generate call")
    ap.add_argument(
        "--backend",
        choices=["auto", "hf", "vllm"],
        default="auto",
        help="auto: vLLM when installed and on a GPU, else transformers",
    )
    ap.add_argument("--dtype", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--system_prompt", help="the run's data.system_prompt, if it sets one")
    ap.add_argument(
        "--encoder", default=PACKAGED_MINILM, type=user_path, help=f"sentence encoder (default {PACKAGED_MINILM})"
    )
    ap.add_argument(
        "--cluster_threshold",
        type=float,
        help="tau_c, the cosine that links two steps; default: the encoder's measured value "
        "(MiniLM 0.88, all-distilroberta-v1 the paper's 0.45)",
    )
    ap.add_argument(
        "--min_support", type=int, default=2, help="drop clusters reached by fewer distinct trajectories (default 2)"
    )
    ap.add_argument("--keep_incorrect", action="store_true", help="keep trajectories whose answer is wrong")
    ap.add_argument(
        "--reference_sets",
        action="store_true",
        help="also keep every accepted trajectory as an alternative chain (reference_sets)",
    )
    ap.add_argument("--rebuild", action="store_true", help="build rows that already have reference_steps too")
    ap.add_argument("--keep_collapsed", action="store_true", help="write chains that look collapsed")
    ap.add_argument("--max_rows", type=int, help="only the first N rows")
    ap.add_argument("--work_dir", type=user_file, help="trajectories and settings (default: OUT.work/ beside --out)")
    ap.add_argument("--device", help="encoder device (default: cuda when available)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--measure_threshold",
        action="store_true",
        help="only measure: how similar different reference steps of one row of --data are with "
        "--encoder, and the --cluster_threshold that keeps 99%% of them apart",
    )
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    """Exit status: 0 built, 1 some rows failed (the rest are written), 2 bad input."""
    args = build_parser().parse_args(argv)
    try:
        for key, low in (
            ("samples", 1),
            ("batch_size", 1),
            ("max_new_tokens", 1),
            ("min_support", 1),
            ("max_rows", 1),
        ):
            if getattr(args, key) is not None and getattr(args, key) < low:
                raise BuildError(f"--{key} {getattr(args, key)}: expected an integer >= {low}")
        if args.measure_threshold:
            m = measure_threshold(args.data, args.encoder, args.device)
            print(
                f"{m['data']}: {m['rows']} rows, {m['pairs']} pairs of different reference steps of one row; "
                f"cosine with {m['encoder']}: median {m['p50']:.3f}, p90 {m['p90']:.3f}, p95 {m['p95']:.3f}, "
                f"p99 {m['p99']:.3f}, max {m['max']:.3f}\nsuggested --cluster_threshold {m['suggested']:.2f} "
                f"(shipped default for this encoder: {m['default']})"
            )
            return 0
        if args.out is None:
            raise BuildError("--out is required")
        if args.samples > 1 and args.temperature <= 0:
            raise BuildError(
                f"--samples {args.samples} with greedy decoding gives identical solutions: set --temperature > 0"
            )
        req = BuildRequest(
            data=args.data,
            out=args.out,
            generators=args.generators,
            trajectories=args.trajectories,
            work_dir=args.work_dir,
            sampling=Sampling(args.max_new_tokens, args.temperature, args.top_p, args.samples),
            batch_size=args.batch_size,
            backend=args.backend,
            dtype=args.dtype,
            system_prompt=args.system_prompt,
            encoder=args.encoder,
            cluster_threshold=args.cluster_threshold,
            min_support=args.min_support,
            keep_incorrect=args.keep_incorrect,
            reference_sets=args.reference_sets,
            rebuild=args.rebuild,
            keep_collapsed=args.keep_collapsed,
            max_rows=args.max_rows,
            device=args.device,
            seed=args.seed,
        )
        summary = build(req)
    except (CrystalError, OSError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 1 if summary["failed"] else 0

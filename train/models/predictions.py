"""The prediction store: completions of a data set in ``predictions.jsonl``, generated in
resumable chunks and read back.

One ``{"id", "sample", "completion"}`` line a sample (or the scorer CLI's ``reasoning_steps``
and ``answer`` instead of ``completion``). Rows are appended a round at a time in the data's
order, so a killed generation continues where it stopped: :func:`drop_partial` removes what a
kill can leave. Evaluation (train/tools/evaluate.py) and reference building (train/tools/build_references.py)
both generate through here, with HF ``generate`` (:mod:`crystal_grpo.train.models.generation`, the
validation callback's code) or vLLM.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Literal

from crystal_grpo.distributed import accelerate_state, barrier, even_share, gather_objects, rank_and_world
from crystal_grpo.errors import CrystalError
from crystal_grpo.jsonl import Unreadable, atomic_write_text, iter_jsonl
from crystal_grpo.rewards.parsing import ParsedOutput
from crystal_grpo.train.models.generation import VLLM_SETUP, Engine, Sampling

PREDICTIONS = "predictions.jsonl"
Backend = Literal["auto", "hf", "vllm"]


class PredictionError(CrystalError, ValueError):
    """A predictions file that cannot be used; the message names the file and line."""


def read_predictions(path: Path, unique: bool = True) -> list[dict]:
    """Prediction rows of a file: each needs ``id`` and either the raw ``completion`` or the
    scorer CLI's ``reasoning_steps`` and ``answer``; a bad line is an error naming it. With
    ``unique`` (an evaluation's) so is a second line for an id (and ``sample``) already given, as
    ``crystal-grpo-score`` refuses it: the scores of one row would be averaged over its lines
    without a word; a file of solutions to build references from may hold any number an id."""
    out = []
    first: dict[tuple[str, int], int] = {}
    for no, row in iter_jsonl(path):
        where = f"{path}:{no}"
        if isinstance(row, Unreadable):
            raise PredictionError(f"{where}: {row.problem}")
        if not isinstance(row, dict) or not isinstance(row.get("id"), (str, int)) or isinstance(row.get("id"), bool):
            raise PredictionError(f"{where}: expected a JSON object with an 'id' (a string or integer)")
        if not isinstance(row.get("completion"), str) and not isinstance(row.get("reasoning_steps"), list):
            raise PredictionError(
                f"{where}: expected 'completion' (the model's text) or 'reasoning_steps' and 'answer'"
            )
        sample = row.get("sample", 0)
        if isinstance(sample, bool) or not isinstance(sample, int) or sample < 0:
            raise PredictionError(
                f"{where}: 'sample' must be an integer >= 0 (the completion's index), not {sample!r}"
            )
        key = (str(row["id"]), sample)
        if unique and key in first:
            which = f" sample {sample}" if "sample" in row else ""
            raise PredictionError(f"{where}: duplicate id {row['id']!r}{which} (first on line {first[key]})")
        first[key] = no
        out.append({**row, "id": key[0], "sample": key[1]})
    return out


def check_ids(predictions: Sequence[dict], ids: Sequence[str], source: str, data: str, complete: bool = True) -> None:
    """Every prediction names a data row; with ``complete``, every data row has a prediction."""
    known = set(ids)
    unknown = sorted({p["id"] for p in predictions} - known)
    predicted = {p["id"] for p in predictions}
    missing = [i for i in ids if i not in predicted] if complete else []
    if unknown or missing:
        parts = []
        if unknown:
            parts.append(f"{len(unknown)} id(s) not in {data} (e.g. {', '.join(unknown[:3])})")
        if missing:
            parts.append(f"{len(missing)} row(s) of {data} without a prediction (e.g. {', '.join(missing[:3])})")
        raise PredictionError(f"{source} does not match the data: " + "; ".join(parts))


def as_completion(pred: dict) -> str | ParsedOutput:
    """The raw completion when there is one (parsed as in training), else the given steps
    and answer as a well-formed output."""
    if isinstance(pred.get("completion"), str):
        return pred["completion"]
    answer = pred.get("answer")
    return ParsedOutput(
        steps=[str(s).strip() for s in pred.get("reasoning_steps") or [] if str(s).strip()],
        answer=None if answer is None else str(answer),
        format_ok=True,
    )


# ------------------------------------------------------------------------------ generation
def _pending(path: Path, ids: Sequence[str], num_samples: int) -> list[int]:
    """Indices of rows still without all their completions (a resumed evaluation)."""
    done: dict[str, int] = {}
    if path.exists():
        for row in read_predictions(path):
            done[row["id"]] = done.get(row["id"], 0) + 1
    return [i for i, rid in enumerate(ids) if done.get(rid, 0) < num_samples]


def drop_partial(path: Path, num_samples: int) -> None:
    """What a kill can leave: a last line cut off mid-write, a row with only some of its
    samples. Both go (the row is generated again); whole rows stay as written."""
    if not path.exists():
        return
    text = path.read_text(encoding="utf-8")
    lines = [x for x in text.split("\n")[:-1] if x.strip()]  # after the last newline: an unfinished line
    try:
        parsed = [json.loads(x) for x in lines]
    except ValueError:
        return  # damaged in the middle: not a kill; reading it names the line
    if not all(isinstance(row, dict) for row in parsed):
        return
    counts: dict[str, int] = {}
    for row in parsed:
        counts[str(row.get("id"))] = counts.get(str(row.get("id")), 0) + 1
    kept = [x for x, row in zip(lines, parsed) if counts[str(row.get("id"))] >= num_samples]
    new = "".join(x + "\n" for x in kept)
    if new != text:
        atomic_write_text(path, new)


def _resume_point(path: Path, ids: Sequence[str], num_samples: int) -> list[int]:
    """The rows to generate, the same on every process (the main one tidies the file first)."""
    rank = rank_and_world()[0]
    if rank == 0:
        drop_partial(path, num_samples)
    barrier()
    pending = _pending(path, ids, num_samples)
    barrier()  # everyone has read the file before the main process appends to it
    return pending


def _append(path: Path, rows: Sequence[tuple[str, Sequence[str]]]) -> None:
    """Append each row's completions, one ``{"id", "sample", "completion"}`` line a sample."""
    with open(path, "a", encoding="utf-8") as fh:
        for rid, completions in rows:
            for k, text in enumerate(completions):
                fh.write(json.dumps({"id": rid, "sample": k, "completion": text}, ensure_ascii=False) + "\n")


def generate_predictions(
    model,
    processing_class,
    dataset,
    out_dir: Path,
    sampling: Sampling,
    batch_size: int,
    progress: bool = True,
    engine: Engine | None = None,
) -> int:
    """Append the missing completions of ``dataset`` to ``out_dir/predictions.jsonl``; returns
    how many rows were generated now. Rows are split over processes round by round (every
    process generates as many rows a round, :func:`even_share`), and the main process writes
    each round in the data's order, so a kill loses at most the round in flight."""
    from crystal_grpo.train.models.generation import generate

    rank, world = rank_and_world()
    path = out_dir / PREDICTIONS
    ids = list(dataset["id"])
    pending = _resume_point(path, ids, sampling.num_samples)
    bar = _progress(len(pending), enabled=progress and rank == 0)
    per_round = batch_size * world
    for start in range(0, len(pending), per_round):
        chunk = pending[start : start + per_round]
        share, own = even_share(len(chunk), rank, world)
        mine = [chunk[i] for i in share]
        rows = [dataset[i] for i in mine]
        images = [r["images"] for r in rows] if rows and "images" in rows[0] else None
        texts = generate(
            model, processing_class, [r["prompt"] for r in rows], images, sampling, batch_size, engine or Engine()
        )
        done, _ = gather_objects(list(zip(mine[:own], texts[:own])))
        if rank == 0:
            _append(path, [(ids[i], completions) for i, completions in sorted(done)])
            bar.update(len(done))
    bar.close()
    return len(pending)


def _progress(total: int, enabled: bool):
    from tqdm.auto import tqdm

    return tqdm(total=total, unit="row", desc="generating", disable=not enabled or total == 0)


def generate_with_vllm(
    model_path: str,
    dataset,
    out_dir: Path,
    sampling: Sampling,
    dtype: str | None = None,
    trust_remote_code: bool = False,
    chat_template_kwargs: dict | None = None,
) -> int:
    """The pending rows through vLLM (one process; vLLM does its own parallelism). Text and
    images go in as the training prompt through the model's chat template."""
    try:
        from vllm import LLM, SamplingParams

        from crystal_grpo.train.data.splits import prompt_text
    except ImportError as err:
        raise PredictionError(f"--backend vllm: vLLM is not installed; {VLLM_SETUP}") from err
    if (Path(model_path) / "adapter_config.json").is_file():
        raise PredictionError(
            f"--backend vllm: {model_path} is a LoRA adapter; merge it first (scripts/export.py "
            f"{model_path} --out FOLDER) or use --backend hf"
        )
    path = out_dir / PREDICTIONS
    ids = list(dataset["id"])
    pending = _resume_point(path, ids, sampling.num_samples)
    if not pending:
        return 0
    llm = LLM(model=model_path, dtype=dtype or "auto", trust_remote_code=trust_remote_code)
    params = SamplingParams(
        n=sampling.num_samples,
        temperature=max(sampling.temperature, 0.0),
        top_p=sampling.top_p,
        max_tokens=sampling.max_new_tokens,
    )
    tok = llm.get_tokenizer()
    requests = []
    for i in pending:
        row = dataset[i]
        text = prompt_text(tok, row["prompt"], chat_template_kwargs)
        requests.append(
            {"prompt": text, **({"multi_modal_data": {"image": row["images"]}} if row.get("images") else {})}
        )
    outputs = llm.generate(requests, params)
    _append(path, [(ids[i], [o.text for o in out.outputs]) for i, out in zip(pending, outputs)])
    return len(pending)


def choose_backend(requested: Backend, world: int) -> str:
    """``auto``: vLLM for one process on a GPU when it is installed, else HF ``generate``."""
    if requested != "auto":
        return requested
    import importlib.util

    import torch

    return "vllm" if world == 1 and torch.cuda.is_available() and importlib.util.find_spec("vllm") else "hf"


def default_device():
    """This process's device: accelerate's once it is set up, else its GPU (``LOCAL_RANK``), else the CPU."""
    import torch

    state = accelerate_state()
    if state is not None:
        return state.device
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")

"""Training data: JSONL rows of SPEC section 1 (or a ``datasets`` folder) -> TRL prompts.

Every row is checked at start-up, so a bad row stops the run before hours of training
rather than crashing it later: each problem is reported as ``file:line: what``. With
``skip_invalid`` the bad rows are dropped and counted instead. Images are checked once
and then loaded lazily, when a batch asks for them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Union

from datasets import Dataset

from crystal_grpo.jsonl import Unreadable, iter_jsonl
from crystal_grpo.typed import option

SYSTEM_PROMPT = (
    "Solve the problem step by step. Reply with exactly one JSON object and nothing else: "
    '{"reasoning_steps": ["<step 1>", "<step 2>", "..."], "answer": "<final answer>"}. '
    "Each step is one short sentence. For multiple choice, answer with the option letter."
)


@dataclass
class DataSection:
    """Training and validation data (``data:`` in a run config)."""

    train: str = option("", "JSONL file (SPEC section 1) or a datasets folder saved with save_to_disk.")
    validation: Union[str, None] = option(None, "Same formats; when absent a fraction of train is held out.")
    validation_fraction: float = option(0.1, "Held-out share of train when validation is not given.", ge=0, lt=1)
    skip_invalid: bool = option(False, "Drop (and count) bad rows instead of stopping with their file:line.")
    max_errors_shown: int = option(20, "How many bad rows a data error lists.", ge=0)
    system_prompt: Union[str, None] = option(None, "Overrides the instruction asking for the JSON output.")
    max_train_samples: Union[int, None] = option(None, "Use only the first N training rows (smoke runs).", ge=1)


class DataError(ValueError):
    """Bad data rows; the message lists ``file:line: problem`` for each."""


@dataclass
class LoadedSplit:
    dataset: Dataset
    skipped: int  # rows dropped by skip_invalid
    source: str


def _read(path: Path) -> list[tuple[int, Any]]:
    """(line number, parsed row or why it is unreadable) for each non-blank line / row."""
    if path.is_dir():
        from datasets import load_from_disk

        return [(i + 1, dict(r)) for i, r in enumerate(load_from_disk(str(path)))]
    return list(iter_jsonl(path))


def _is_text(x: Any) -> bool:
    return isinstance(x, str) and bool(x.strip())


def row_problems(row: Any, base: Path) -> list[str]:
    """What is wrong with one row (empty when it is fine)."""
    if isinstance(row, Unreadable):
        return [row.problem]
    if not isinstance(row, dict):
        return [f"expected a JSON object, got {type(row).__name__}"]
    out = []
    if not _is_text(row.get("question")):
        out.append("missing or empty 'question'")
    ans = row.get("answer")
    if isinstance(ans, float) and not math.isfinite(ans):
        out.append(f"'answer' is {ans} (JSON NaN/Infinity): it must be a string or a finite number")
    elif isinstance(ans, bool) or not (_is_text(ans) or isinstance(ans, (int, float))):
        out.append("missing or empty 'answer' (a string or number)")
    steps = row.get("reference_steps")
    if not isinstance(steps, list) or not steps or not all(_is_text(s) for s in steps):
        out.append("'reference_steps' must be a non-empty list of non-empty strings")
    sets = row.get("reference_sets")
    if sets is not None and not (isinstance(sets, list) and all(
            isinstance(c, list) and c and all(_is_text(s) for s in c) for c in sets)):
        out.append("'reference_sets' must be a list of non-empty lists of strings")
    choices = row.get("choices")
    if choices is not None and not (isinstance(choices, list) and all(_is_text(c) for c in choices)):
        out.append("'choices' must be a list of strings")
    for img in _image_paths(row, base):
        out.extend(_image_problem(img))
    return out


def _image_paths(row: dict, base: Path) -> list[Path]:
    imgs = row.get("images") if row.get("images") is not None else (
        [row["image"]] if row.get("image") is not None else [])
    if not isinstance(imgs, list):
        imgs = [imgs]
    return [p if p.is_absolute() else base / p for p in (Path(str(x)) for x in imgs)]


def _image_problem(path: Path) -> list[str]:
    from PIL import Image

    try:
        with Image.open(path) as im:
            im.verify()
    except Exception as err:  # noqa: BLE001 - any failure means unreadable
        return [f"unreadable image {str(path)!r} ({type(err).__name__}: {err})"]
    return []


def build_prompt(row: dict, system_prompt: str | None = None) -> list[dict]:
    """Conversational prompt: system instruction, then the question (and options)."""
    text = row["question"].strip()
    if row.get("choices"):
        letters = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"
        text += "\nOptions: " + " ".join(f"({letters[i]}) {c}" for i, c in enumerate(row["choices"]))
    return [{"role": "system", "content": system_prompt or SYSTEM_PROMPT},
            {"role": "user", "content": text}]


def _to_record(row: dict, base: Path, no: int, path: Path, system_prompt: str | None) -> dict:
    return {
        "id": str(row.get("id", f"{path.name}:{no}")),
        "prompt": build_prompt(row, system_prompt),
        "answer": str(row["answer"]),
        "reference_steps": [s.strip() for s in row["reference_steps"]],
        "reference_sets": row.get("reference_sets"),
        "choices": row.get("choices"),
        "source": str(row.get("source", "")),
        "images": [str(p) for p in _image_paths(row, base)],
    }


def _load_images(batch: dict) -> dict:
    """``datasets`` transform: open image files only when a batch is read."""
    from PIL import Image

    if "images" in batch:
        batch["images"] = [[Image.open(p).convert("RGB") for p in paths] for paths in batch["images"]]
    return batch


def load_split(path: str | Path, *, skip_invalid: bool = False, max_errors_shown: int = 20,
               system_prompt: str | None = None, limit: int | None = None) -> LoadedSplit:
    path = Path(path)
    if not path.exists():
        raise DataError(f"{path}: no such file or folder")
    base = path if path.is_dir() else path.parent
    records, errors, bad_rows = [], [], 0
    for no, row in _read(path):
        problems = row_problems(row, base)
        if problems:
            errors.extend(f"{path}:{no}: {p}" for p in problems)
            bad_rows += 1
            continue
        records.append(_to_record(row, base, no, path, system_prompt))
    if errors and not skip_invalid:
        shown = "\n  ".join(errors[:max_errors_shown])
        more = f"\n  ... and {len(errors) - max_errors_shown} more" if len(errors) > max_errors_shown else ""
        raise DataError(f"{bad_rows} invalid row(s) in {path} (set data.skip_invalid: true to drop them):"
                        f"\n  {shown}{more}")
    if not records:
        raise DataError(f"{path}: no valid rows")
    if limit is not None:
        records = records[:limit]
    # Optional columns exist for every row or for none (Arrow needs one schema).
    has_images = any(r["images"] for r in records)
    has_sets = any(r["reference_sets"] for r in records)
    for r in records:
        if not has_images:
            del r["images"]
        if not has_sets:
            del r["reference_sets"]
        r["choices"] = r["choices"] or []
    ds = Dataset.from_list(records)
    if has_images:
        ds = ds.with_transform(_load_images)
    return LoadedSplit(ds, bad_rows if skip_invalid else 0, str(path))


def load_datasets(data_cfg: DataSection, seed: int = 42) -> tuple[LoadedSplit, LoadedSplit | None]:
    """Train and validation splits from files, or validation held out from train."""
    opts = dict(skip_invalid=data_cfg.skip_invalid, max_errors_shown=data_cfg.max_errors_shown,
                system_prompt=data_cfg.system_prompt)
    train = load_split(data_cfg.train, limit=data_cfg.max_train_samples, **opts)
    if data_cfg.validation:
        return train, load_split(data_cfg.validation, **opts)
    if data_cfg.validation_fraction <= 0:
        return train, None
    split = train.dataset.train_test_split(test_size=data_cfg.validation_fraction, seed=seed)
    return (LoadedSplit(split["train"], train.skipped, train.source),
            LoadedSplit(split["test"], 0, train.source + " (held out)"))

"""Training data: rows of docs/method.md section 1 -> the splits a run trains and validates on.

The concepts live in their own modules, and this one composes them: reading and locating
rows (:mod:`~crystal_grpo.train.data.reading`), their images (:mod:`~crystal_grpo.train.data.images`),
what is wrong with a row (:mod:`~crystal_grpo.train.data.row_problems`), prompts and records
(:mod:`~crystal_grpo.train.data.prompts`). Here: the ``data:`` section, one checked split
(:func:`load_split`), train and validation (:func:`load_datasets`), and prompts too long for
the model's context (:func:`limit_prompt_lengths`). Every row is checked at start-up, so a
bad row stops the run before hours of training rather than crashing it later: each problem
is reported as ``file:N: what`` (N: the line of a JSONL file, else the 1-based row). With
``skip_invalid`` the bad rows are dropped and counted instead. The public names of those
modules are importable from here too.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Union

from crystal_grpo.rewards.batch import MAX_SCORED_STEPS
from crystal_grpo.train.data.images import ImageLoader, image_paths, image_problem, own_image_loader
from crystal_grpo.train.data.prompts import (
    MAX_TRUNCATED_SHARE,
    SYSTEM_PROMPT,
    build_prompt,
    encode_example,
    prompt_text,
    render_target,
    sft_dataset,
    target_lengths,
    to_record,
    truncation_warning,
)
from crystal_grpo.train.data.reading import DataError, image_store, iter_rows, locate, read_rows
from crystal_grpo.train.data.row_problems import (
    long_references_line,
    longest_chain,
    name_columns,
    row_problems,
    special_token_problem,
)
from crystal_grpo.typed import option

if TYPE_CHECKING:
    from datasets import Dataset

__all__ = [  # this module's own, then the names of the modules it composes
    "DataSection",
    "LoadedSplit",
    "load_split",
    "load_datasets",
    "context_length",
    "limit_prompt_lengths",
    "DataError",
    "locate",
    "read_rows",
    "image_store",
    "ImageLoader",
    "image_paths",
    "image_problem",
    "own_image_loader",
    "row_problems",
    "SYSTEM_PROMPT",
    "MAX_TRUNCATED_SHARE",
    "build_prompt",
    "encode_example",
    "prompt_text",
    "render_target",
    "sft_dataset",
    "target_lengths",
    "truncation_warning",
]


# The row fields of docs/method.md section 1 that data.columns may map other names onto.
Field = Literal[
    "id",
    "question",
    "answer",
    "reference_steps",
    "reference_sets",
    "choices",
    "images",
    "image",
    "source",
    "difficulty",
]


@dataclass
class DataSection:
    """Training and validation data (``data:`` in a run config)."""

    train: str = option(
        "",
        "Rows of docs/method.md section 1: a JSONL, JSON or Parquet file, a datasets folder or a cached "
        "Hub dataset id.",
    )
    validation: Union[str, None] = option(
        None, "Validation rows, in the same formats (absent: a share of train held out)."
    )
    train_split: str = option("train", "Split of a dataset folder or Hub dataset used for training.")
    validation_split: str = option("validation", "Split used for validation when validation names a dataset.")
    columns: dict[Field, str] = option(
        default_factory=dict,
        help="Our field -> the data's column, e.g. {question: problem, answer: solution, reference_steps: steps}.",
    )
    validation_fraction: float = option(0.1, "Held-out share of train when validation is not given.", ge=0, lt=1)
    skip_invalid: bool = option(False, "Drop (and count) bad rows instead of stopping with their file:line.")
    max_errors_shown: int = option(20, "How many bad rows a data error lists.", ge=0)
    system_prompt: Union[str, None] = option(None, "Overrides the instruction asking for the JSON output.")
    chat_template_kwargs: dict[str, Any] = option(
        default_factory=dict,
        help="Keyword arguments of the chat template wherever a prompt is rendered, e.g. "
        "{enable_thinking: false} (training.chat_template_kwargs lands here).",
    )
    max_train_samples: Union[int, None] = option(None, "Use only the first N training rows (smoke runs).", ge=1)
    long_prompts: Literal["skip", "error", "keep"] = option(
        "skip",
        "Prompts that leave no room for the completion in the model's context: skip (counted and named), "
        "error, or keep.",
    )


#: Records turned into Arrow at a time while a split loads: only the table and one chunk of Python
#: objects are held at once (a list of every row's dicts, and its conversion, took several KB a row).
RECORD_CHUNK = 8192


def _record_features() -> Any:
    """The columns of a split's records (prompts/to_record), typed once: every chunk the same schema."""
    from datasets import Features, List, Value

    text = Value("string")
    return Features(
        {
            "id": text,
            "prompt": List({"role": text, "content": text}),
            "answer": text,
            "reference_steps": List(text),
            "reference_sets": List(List(text)),
            "choices": List(text),
            "source": text,
            "difficulty": text,
            "images": List(text),
        }
    )


@dataclass
class LoadedSplit:
    dataset: Dataset
    skipped: int  # rows dropped by skip_invalid
    source: str
    warnings: tuple[str, ...] = ()  # what the run says about these rows (long references)


def load_split(
    source: str | Path,
    *,
    skip_invalid: bool = False,
    max_errors_shown: int = 20,
    system_prompt: str | None = None,
    limit: int | None = None,
    split: str = "train",
    columns: Mapping[str, str] | None = None,
    require_references: bool = True,
    skip_option: str | None = "data.skip_invalid: true",
    unique_ids: str | None = None,
    special_tokens: Sequence[str] = (),
) -> LoadedSplit:
    """Rows of one source (see :func:`locate`), each checked; ``skip_option`` is how the caller's
    user asks to drop bad ones (None: the caller has no such option). ``unique_ids`` (why the
    caller needs them) makes a row whose ``id`` an earlier row has a bad row; training needs no
    unique ids, rows are rows there. ``special_tokens``: the model's, which no prompt may hold."""
    from datasets import Dataset, concatenate_datasets

    features = _record_features()
    path = locate(source)
    columns = columns or {}
    base = path if path.is_dir() else path.parent
    parts, records, errors, problem_count, bad_rows, longest = [], [], [], 0, 0, []
    where: dict[tuple, str] = {}  # each image list's first row
    first: dict[str, int] = {}
    kept, has_sets = 0, False
    for no, row in iter_rows(path, split, columns):  # one row at a time, its record joining a chunk
        problems = [name_columns(p, columns) for p in row_problems(row, base, require_references, special_tokens)]
        if unique_ids and not problems and "id" in row:
            rid = str(row["id"])
            if rid in first:
                problems.append(f"duplicate id {rid!r} (first at {source}:{first[rid]}): {unique_ids}")
            first.setdefault(rid, no)
        if problems:
            errors.extend(f"{source}:{no}: {p}" for p in problems[: max(0, max_errors_shown - len(errors))])
            problem_count += len(problems)
            bad_rows += 1
            continue
        if limit is not None and kept >= limit:
            continue  # (every row is still checked)
        record = to_record(row, base, no, Path(str(source)), system_prompt)
        record["choices"] = record["choices"] or []
        kept += 1
        has_sets = has_sets or bool(record["reference_sets"])
        if record["images"]:
            where.setdefault(tuple(record["images"]), f"{source}:{no}")
        if (steps := longest_chain(row)) > MAX_SCORED_STEPS:
            longest.append((f"{source}:{no}", steps))
        records.append(record)
        if len(records) == RECORD_CHUNK:
            parts.append(Dataset.from_list(records, features=features))
            records = []
    if bad_rows and not skip_invalid:
        shown = "\n  ".join(errors)
        more = f"\n  ... and {problem_count - len(errors)} more" if problem_count > len(errors) else ""
        hint = f"set {skip_option} to drop them" if skip_option else "fix or remove them"
        raise DataError(f"{bad_rows} invalid row(s) in {source} ({hint}):\n  {shown}{more}")
    if not kept:
        raise DataError(f"{source}: no valid rows")
    parts += [Dataset.from_list(records, features=features)] if records else []
    ds = concatenate_datasets(parts) if len(parts) > 1 else parts[0]
    # Optional columns exist for every row or for none (one schema); absent from every row, they go.
    ds = ds.remove_columns([c for c, used in (("images", where), ("reference_sets", has_sets)) if not used])
    if where:
        ds = own_image_loader(ds, where)
    long_refs = long_references_line(str(source), longest, MAX_SCORED_STEPS)
    return LoadedSplit(ds, bad_rows if skip_invalid else 0, str(source), (long_refs,) if long_refs else ())


def load_datasets(
    data_cfg: DataSection, seed: int = 42, special_tokens: Sequence[str] = ()
) -> tuple[LoadedSplit, LoadedSplit | None]:
    """Train and validation splits from files, or validation held out from train."""
    opts = dict(
        skip_invalid=data_cfg.skip_invalid,
        max_errors_shown=data_cfg.max_errors_shown,
        system_prompt=data_cfg.system_prompt,
        columns=data_cfg.columns,
        special_tokens=special_tokens,
    )
    train = load_split(data_cfg.train, limit=data_cfg.max_train_samples, split=data_cfg.train_split, **opts)
    if data_cfg.validation:
        return train, load_split(data_cfg.validation, split=data_cfg.validation_split, **opts)
    if data_cfg.validation_fraction <= 0:
        return train, None
    split = train.dataset.train_test_split(test_size=data_cfg.validation_fraction, seed=seed)
    return (
        LoadedSplit(own_image_loader(split["train"]), train.skipped, train.source, train.warnings),
        LoadedSplit(own_image_loader(split["test"]), 0, train.source + " (held out)"),
    )


def same_rows_line(data_cfg: DataSection) -> str | None:
    """A warning when the validation rows are the training rows (one file, one split): validation, and
    the best checkpoint it picks, then measure what the run trained on, not what it learned."""
    train, val = data_cfg.train, data_cfg.validation
    if not train or not val or os.path.realpath(train) != os.path.realpath(val):
        return None
    if not os.path.isfile(train) and data_cfg.train_split != data_cfg.validation_split:
        return None  # (a data set's two splits)
    return (
        f"data.validation is data.train ({val}): validation, and the best checkpoint it picks, score rows the run "
        "trains on; give held-out rows, or leave data.validation out (data.validation_fraction holds rows out)"
    )


def check_rows(
    key: str, source: str | None, data_cfg: DataSection, special_tokens: Sequence[str]
) -> tuple[list[str], list[str]]:
    """What ``--check`` says of the rows of a local data file (``key``: ``data.train`` or
    ``data.validation``), read as the run reads them, without ``datasets`` (a folder or a Hub
    dataset is checked when the run loads it): (problems, warnings). A problem is a prompt holding
    one of the model's special tokens (``key: file:N: ...``), a warning reference chains longer
    than a reward scores."""
    path = Path(source) if source else None
    if path is None or not path.is_file():
        return [], []
    split = data_cfg.train_split if key == "data.train" else data_cfg.validation_split
    problems, longest = [], []
    for no, row in read_rows(locate(path), split, data_cfg.columns):
        if not isinstance(row, dict):
            continue  # (the run names unreadable rows)
        injected = special_token_problem(row, special_tokens)
        if injected:
            problems.append(f"{key}: {source}:{no}: {name_columns(injected, data_cfg.columns)}")
        longest.append((f"{source}:{no}", longest_chain(row)))
    warnings = [f"{key}: {w}"] if (w := long_references_line(source, longest, MAX_SCORED_STEPS)) else []
    if problems and data_cfg.skip_invalid:
        return [], [f"{problems[0]}; {len(problems)} such row(s), which the run skips (data.skip_invalid)", *warnings]
    shown = data_cfg.max_errors_shown
    if len(problems) > shown:
        problems[shown:] = [f"{key}: ... and {len(problems) - shown} more"]
    return problems, warnings


def batch_problem(split: LoadedSplit, args: Any) -> str | None:
    """Why ``split`` cannot fill one GRPO generation batch, or None. TRL's sampler (and the
    curriculum's) yields only whole batches of distinct prompts, so fewer prompts than one
    takes trained 0 steps, exited 0 and saved the starting weights as ``final/``."""
    need = args.generation_batch_size // args.num_generations
    if len(split.dataset) >= need:
        return None
    return (
        f"{split.source}: {len(split.dataset)} training prompt(s), fewer than one generation batch takes "
        f"({need} = generation_batch_size {args.generation_batch_size} / num_generations {args.num_generations}; "
        "per_device_train_batch_size x processes x steps_per_generation completions): the run would train 0 "
        "steps; give more rows (data.max_train_samples) or a smaller training.per_device_train_batch_size"
    )


def context_length(model: Any) -> int | None:
    """The model's positions (``max_position_embeddings``, of its text model for a VLM), or None."""
    config = getattr(model, "config", None)
    for c in (config, getattr(config, "text_config", None)):
        n = getattr(c, "max_position_embeddings", None)
        if isinstance(n, int) and n > 0:
            return n
    return None


#: Characters a normaliser may merge into one: NFC composes at most 4 (Unicode's longest canonical
#: decomposition), so a text's normalised length is at least a quarter of its own.
MAX_MERGED_CHARS = 4


def max_token_chars(tok: Any) -> int:
    """The most characters of a text one token of ``tok`` can stand for: its longest vocabulary
    entry (a byte-level entry spells one byte a character, and a character is one byte or more),
    times :data:`MAX_MERGED_CHARS`. A prompt longer than ``room`` times this cannot fit in ``room``
    tokens: it is skipped without tokenising it (a 50 MB row took minutes and 9 GB to tokenise)."""
    return MAX_MERGED_CHARS * max(map(len, tok.get_vocab()), default=1)


#: Prompts rendered and tokenized at a time when their lengths are measured: a tokenizer's output
#: for a whole data set (its encodings, about 10 KB a prompt) held gigabytes.
LENGTH_CHUNK = 1024


def limit_prompt_lengths(
    split: LoadedSplit,
    tokenizer: Any,
    room: int,
    mode: str,
    key: str,
    chat_template_kwargs: Mapping[str, Any] | None = None,
) -> tuple[LoadedSplit, str | None]:
    """Prompts longer than ``room`` tokens (the context minus the completion's tokens), per
    ``data.long_prompts``: dropped, an error, or kept; returns the split and a warning line.
    Image tokens are not counted (their number depends on the processor's resizing)."""
    tok = getattr(tokenizer, "tokenizer", tokenizer)
    raw = split.dataset.with_format(None)
    bound = room * max_token_chars(tok)
    long = []
    for start in range(0, len(raw), LENGTH_CHUNK):  # a chunk at a time: only the lengths stay
        texts = [prompt_text(tok, p, chat_template_kwargs) for p in raw[start : start + LENGTH_CHUNK]["prompt"]]
        fit = [i for i, text in enumerate(texts) if len(text) <= bound]  # the rest cannot fit: never tokenised
        ids = tok([texts[i] for i in fit], add_special_tokens=False, return_attention_mask=False)["input_ids"]
        lengths = dict(zip(fit, map(len, ids))) if fit else {}
        long += [start + i for i in range(len(texts)) if lengths.get(i, room + 1) > room]
    if not long:
        return split, None
    ids = ", ".join(str(raw[i]["id"]) for i in long[:5]) + (" ..." if len(long) > 5 else "")
    what = (
        f"{len(long)} of {len(raw)} prompt(s) of {split.source} leave no room for {key}: longer than "
        f"{room} tokens (e.g. {ids})"
    )
    if mode == "error":
        raise DataError(f"{what}; shorten them, or set data.long_prompts: skip")
    if mode == "keep":
        return split, f"{what}; kept (data.long_prompts: keep): their completions run past the model's context"
    dropped = set(long)
    keep = [i for i in range(len(raw)) if i not in dropped]
    if not keep:
        raise DataError(f"{what}: none is left")
    return (
        LoadedSplit(own_image_loader(split.dataset.select(keep)), split.skipped, split.source),
        f"{what}; skipped (data.long_prompts: skip)",
    )

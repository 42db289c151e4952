"""Training data: rows of docs/method.md section 1 -> TRL prompts.

Rows come as data is found in the field: JSONL, a JSON array, Parquet, a folder saved
with ``save_to_disk``, a folder of data files or a clone of a Hub dataset repository (what
``datasets.load_dataset`` reads), or a Hub dataset id already in the local cache (offline).
``data.columns`` maps other column names onto ours. Every row is checked at start-up, so a
bad row stops the run before hours of training rather than crashing it later: each problem
is reported as ``file:N: what`` (N: the line of a JSONL file, else the 1-based row). With
``skip_invalid`` the bad rows are dropped and counted instead. Images are checked once and
then loaded lazily, when a batch asks for them; images stored inside the data (Parquet,
Hub datasets) are written once to a content-addressed folder of the ``datasets`` cache.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Union

from crystal_grpo.errors import CrystalError
from crystal_grpo.jsonl import Unreadable, iter_jsonl
from crystal_grpo.typed import option

if TYPE_CHECKING:
    from datasets import Dataset

logger = logging.getLogger(__name__)

SYSTEM_PROMPT = (
    "Solve the problem step by step. Reply with exactly one JSON object and nothing else: "
    '{"reasoning_steps": ["<step 1>", "<step 2>", "..."], "answer": "<final answer>"}. '
    "Each step is one short sentence. For multiple choice, answer with the option letter."
)


# The row fields of docs/method.md section 1 that data.columns may map other names onto.
Field = Literal["id", "question", "answer", "reference_steps", "reference_sets", "choices", "images", "image",
                "source", "difficulty"]


@dataclass
class DataSection:
    """Training and validation data (``data:`` in a run config)."""

    train: str = option("", "Rows of docs/method.md section 1: a JSONL, JSON (array) or Parquet file, a datasets "
                            "folder (save_to_disk, data files, a Hub repository clone) or a Hub dataset id in the "
                            "local cache.")
    validation: Union[str, None] = option(None, "Same formats; when absent a fraction of train is held out.")
    train_split: str = option("train", "Split of a dataset folder or Hub dataset used for training.")
    validation_split: str = option("validation", "Split used for validation when validation names a dataset.")
    columns: dict[Field, str] = option(default_factory=dict, help="Our field -> the data's column, e.g. "
                                       "{question: problem, answer: solution, reference_steps: steps}.")
    validation_fraction: float = option(0.1, "Held-out share of train when validation is not given.", ge=0, lt=1)
    skip_invalid: bool = option(False, "Drop (and count) bad rows instead of stopping with their file:line.")
    max_errors_shown: int = option(20, "How many bad rows a data error lists.", ge=0)
    system_prompt: Union[str, None] = option(None, "Overrides the instruction asking for the JSON output.")
    chat_template_kwargs: dict[str, Any] = option(
        default_factory=dict, help="Keyword arguments of the chat template wherever a prompt is rendered: rollouts, "
        "the SFT phase, validation, evaluation (e.g. {enable_thinking: false}); training.chat_template_kwargs, "
        "TRL's name, lands here.")
    max_train_samples: Union[int, None] = option(None, "Use only the first N training rows (smoke runs).", ge=1)
    long_prompts: Literal["skip", "error", "keep"] = option(
        "skip", "Prompts whose tokens leave no room for the completion in the model's context "
        "(max_position_embeddings): skip them (counted and named), stop with an error, or keep them.")


class DataError(CrystalError, ValueError):
    """Bad data rows; the message lists ``file:line: problem`` for each."""


@dataclass
class LoadedSplit:
    dataset: Dataset
    skipped: int  # rows dropped by skip_invalid
    source: str


_HUB_ID = re.compile(r"[\w.-]+/[\w.-]+")


def locate(source: str | Path) -> Path:
    """A local file or folder, or the snapshot of a Hub dataset repository already in the
    local Hugging Face cache (nothing is downloaded)."""
    path = Path(source)
    if path.exists():
        return path
    if _HUB_ID.fullmatch(str(source)):
        from huggingface_hub import snapshot_download

        try:
            return Path(snapshot_download(str(source), repo_type="dataset", local_files_only=True))
        except Exception:  # not cached (the error type differs across huggingface_hub versions)
            from huggingface_hub.constants import HF_HUB_CACHE

            raise DataError(f"{source}: no such file or folder, and no dataset repository of that name in the local "
                            f"Hugging Face cache ({HF_HUB_CACHE}); fetch it first with: "
                            f"huggingface-cli download --repo-type dataset {source}") from None
    raise DataError(f"{path}: no such file or folder")


def read_rows(path: Path, split: str = "train", columns: Mapping[str, str] | None = None) -> list[tuple[int, Any]]:
    """(line or row number, the row or why it is unreadable) for each row, renamed by ``columns``."""
    if path.is_dir():
        rows = _dataset_rows(path, split)
    elif path.suffix == ".parquet":
        import pyarrow.parquet as pq

        try:
            rows = list(enumerate(pq.read_table(path).to_pylist(), 1))
        except Exception as err:  # pyarrow raises several types for a damaged file
            raise DataError(f"{path}: not a readable Parquet file ({type(err).__name__}: {err})") from None
    elif path.suffix == ".json" and _first_char(path) == "[":
        rows = _json_array(path)
    else:
        rows = list(iter_jsonl(path))
    return [(no, _with_image_files(_rename(row, columns) if columns else row)) for no, row in rows]


def _first_char(path: Path) -> str:
    with open(path, "rb") as fh:
        head = fh.read(4096).lstrip(b"\xef\xbb\xbf \t\r\n")
    return head[:1].decode("latin-1")


def _json_array(path: Path) -> list[tuple[int, Any]]:
    try:
        rows = json.loads(path.read_text(encoding="utf-8-sig"))
    except UnicodeDecodeError as err:
        raise DataError(f"{path}: not UTF-8 text ({err.reason} at byte {err.start})") from None
    except (json.JSONDecodeError, RecursionError, ValueError) as err:
        where = f" (line {err.lineno}, column {err.colno})" if isinstance(err, json.JSONDecodeError) else ""
        raise DataError(f"{path}: invalid JSON{where}: {getattr(err, 'msg', err)}") from None
    return list(enumerate(rows, 1))


def _dataset_rows(path: Path, split: str) -> list[tuple[int, Any]]:
    """A folder written by ``save_to_disk``, or one ``datasets.load_dataset`` reads (data
    files, a Hub repository's layout); images stay undecoded bytes until a batch needs them."""
    from datasets import DatasetDict, load_dataset, load_from_disk

    saved = any((path / f).exists() for f in ("dataset_info.json", "state.json", "dataset_dict.json"))
    try:
        ds = load_from_disk(str(path)) if saved else load_dataset(str(path))
    except Exception as err:  # datasets raises many types for a folder it cannot read
        raise DataError(f"{path}: not a dataset folder ({type(err).__name__}: {str(err)[:300]})") from None
    if isinstance(ds, DatasetDict):
        if split not in ds:
            raise DataError(f"{path}: no split {split!r}; it has {', '.join(ds)} (data.train_split / "
                            "data.validation_split choose one)")
        ds = ds[split]
    ds = _undecoded_images(ds)
    return [(i + 1, dict(r)) for i, r in enumerate(ds)]


def _undecoded_images(ds: Dataset) -> Dataset:
    from datasets import Image

    for name, feature in ds.features.items():
        inner = getattr(feature, "feature", None)
        if isinstance(feature, Image) and feature.decode:
            ds = ds.cast_column(name, Image(decode=False))
        elif isinstance(inner, Image) and inner.decode:
            ds = ds.cast_column(name, type(feature)(Image(decode=False)))
    return ds


def _rename(row: Any, columns: Mapping[str, str]) -> Any:
    if not isinstance(row, dict):
        return row
    out = {k: v for k, v in row.items() if k not in columns.values()}
    out.update({ours: row[theirs] for ours, theirs in columns.items() if theirs in row})
    return out


def _name_columns(problem: str, columns: Mapping[str, str]) -> str:
    """A problem worded with the data's own column names where data.columns renamed them."""
    for ours, theirs in columns.items():
        problem = problem.replace(f"'{ours}'", f"'{theirs}' (data.columns.{ours})")
    return problem


def image_store() -> Path:
    """Where images stored inside data files are written, once, by content hash."""
    import datasets

    return Path(datasets.config.HF_DATASETS_CACHE) / "crystal_grpo_images"


def _stored_image(data: bytes, name: str) -> Path:
    path = image_store() / (hashlib.sha256(data).hexdigest()[:32] + (Path(name).suffix or ".img"))
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        tmp.write_bytes(data)
        os.replace(tmp, path)  # several processes may load the same data at once
    return path


def _is_text(x: Any) -> bool:
    return isinstance(x, str) and bool(x.strip())


def row_problems(row: Any, base: Path, require_references: bool = True) -> list[str]:
    """What is wrong with one row (empty when it is fine). Without ``require_references`` a row
    may lack reference steps (what ``build_references`` fills in); given ones are still checked."""
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
    if (require_references or steps not in (None, [])) and (
            not isinstance(steps, list) or not steps or not all(_is_text(s) for s in steps)):
        out.append("'reference_steps' must be a non-empty list of non-empty strings")
    sets = row.get("reference_sets")
    if sets is not None and not (isinstance(sets, list) and all(
            isinstance(c, list) and c and all(_is_text(s) for s in c) for c in sets)):
        out.append("'reference_sets' must be a list of non-empty lists of strings")
    choices = row.get("choices")
    if choices is not None and not (isinstance(choices, list) and all(_is_text(c) for c in choices)):
        out.append("'choices' must be a list of strings")
    for img in image_paths(row, base):
        out.extend(_image_problem(img))
    return out


def image_paths(row: dict, base: Path) -> list[Path]:
    imgs = row.get("images") if row.get("images") is not None else (
        [row["image"]] if row.get("image") is not None else [])
    if not isinstance(imgs, list):
        imgs = [imgs]
    return [_image_path(x, base) for x in imgs]


def _image_path(x: Any, base: Path) -> Path:
    """A path as given, relative to the data (``datasets``' ``{"path"}`` form too)."""
    p = Path(str(x["path"] if isinstance(x, dict) and x.get("path") else x))
    return p if p.is_absolute() else base / p


def _embedded(x: Any) -> bool:
    return isinstance(x, (bytes, bytearray)) or (isinstance(x, dict) and bool(x.get("bytes")))


def _with_image_files(row: Any) -> Any:
    """The row with each image held in the data (``datasets``' ``{"bytes", "path"}`` form, or
    raw bytes) replaced by the path of its stored copy: written and hashed once, at reading,
    and the row stays JSON (``build_references`` writes rows back)."""
    if not isinstance(row, dict):
        return row
    for key in ("images", "image"):
        value = row.get(key)
        items = value if isinstance(value, list) else [value]
        if any(_embedded(x) for x in items):
            stored = [(str(_stored_image(x["bytes"], str(x.get("path") or ""))) if isinstance(x, dict)
                       else str(_stored_image(bytes(x), ""))) if _embedded(x) else x for x in items]
            row = {**row, key: stored if isinstance(value, list) else stored[0]}
    return row


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


def render_target(row: Mapping[str, Any]) -> str:
    """The completion a perfect policy writes for a row (docs/method.md section 2): what the SFT warm
    start trains on and what the length check measures."""
    return json.dumps({"reasoning_steps": list(row["reference_steps"]), "answer": row["answer"]},
                      ensure_ascii=False)


def prompt_text(processing_class: Any, messages: list[dict], chat_template_kwargs: Mapping[str, Any] | None = None) -> str:
    """A conversational prompt rendered for generation: the one rendering every path uses
    (validation, evaluation, the SFT phase, length checks), with the run's
    ``data.chat_template_kwargs`` as TRL's rollouts use them."""
    return processing_class.apply_chat_template(messages, add_generation_prompt=True, tokenize=False,
                                                **(chat_template_kwargs or {}))


def encode_example(tokenizer: Any, row: Mapping[str, Any],
                   chat_template_kwargs: Mapping[str, Any] | None = None) -> tuple[list[int], list[int]]:
    """A row's prompt tokens exactly as GRPO generates from them, and the target completion's
    tokens up to the end of the turn, tokenized APART: joined, a byte-level BPE may merge the
    prompt's last character with the target's first, and the model would learn a context it
    never sees when generating (TRL warns about that for prompt-completion data)."""
    tok = getattr(tokenizer, "tokenizer", tokenizer)
    prompt = prompt_text(tok, row["prompt"], chat_template_kwargs)
    target = render_target(row)
    full = tok.apply_chat_template([*row["prompt"], {"role": "assistant", "content": target}], tokenize=False,
                                   **(chat_template_kwargs or {}))
    completion = full[len(prompt):] if full.startswith(prompt) else target + (tok.eos_token or "")
    if tok.eos_token and tok.eos_token in completion:  # generation stops there
        completion = completion[:completion.index(tok.eos_token) + len(tok.eos_token)]
    return (tok(prompt, add_special_tokens=False)["input_ids"],
            tok(completion, add_special_tokens=False)["input_ids"])


def sft_dataset(ds: Dataset, processing_class: Any, chat_template_kwargs: Mapping[str, Any] | None = None) -> Dataset:
    """Rows for TRL's SFTTrainer with the loss on the target only: text rows pre-tokenized
    (``input_ids`` and ``labels``, -100 on the prompt; :func:`encode_example`), rows with
    images as prompt-completion messages (TRL's vision collator tokenizes the two apart)."""
    raw = ds.with_format(None)  # the image paths, not the loading transform
    if "images" in raw.column_names:
        extra = {"chat_template_kwargs": dict(chat_template_kwargs)} if chat_template_kwargs else {}  # TRL's column
        out = raw.map(lambda r: {"completion": [{"role": "assistant", "content": render_target(r)}], **extra},
                      remove_columns=[c for c in raw.column_names if c not in ("prompt", "images")])
        loader = ImageLoader.of(ds)
        return own_image_loader(out, loader.where if loader else {})

    def encode(row: dict) -> dict:
        prompt, completion = encode_example(processing_class, row, chat_template_kwargs)
        return {"input_ids": prompt + completion, "labels": [-100] * len(prompt) + completion}

    return raw.map(encode, remove_columns=raw.column_names)


#: Share of the targets a length limit may cut off before the run warns (no silent truncation).
MAX_TRUNCATED_SHARE = 0.05


def target_lengths(tokenizer: Any, rows: Sequence[Mapping[str, Any]], with_prompt: bool = False,
                   chat_template_kwargs: Mapping[str, Any] | None = None) -> list[int]:
    """Token lengths of the target completions (end of turn included: what generation must
    fit in), or of prompt + target (SFT's ``max_length``)."""
    pairs = [encode_example(tokenizer, r, chat_template_kwargs) for r in rows]
    return [len(c) + (len(p) if with_prompt else 0) for p, c in pairs]


def truncation_warning(lengths: Sequence[int], limit: int | None, key: str) -> str | None:
    """A warning when ``limit`` cuts off more than MAX_TRUNCATED_SHARE of the targets, else None."""
    if limit is None or not lengths or limit <= 0:
        return None
    over = sum(n > limit for n in lengths) / len(lengths)
    if over <= MAX_TRUNCATED_SHARE:
        return None
    ordered = sorted(lengths)
    p95 = ordered[min(len(ordered) - 1, math.ceil(0.95 * len(ordered)) - 1)]
    return (f"{key}={limit} cuts off {over:.0%} of the reference answers rendered as the target JSON "
            f"(tokens: mean {sum(lengths) / len(lengths):.0f}, p95 {p95}, max {ordered[-1]}); a completion "
            f"that long fails the format check. Raise it to at least {p95}.")


def _to_record(row: dict, base: Path, no: int, path: Path, system_prompt: str | None) -> dict:
    return {
        "id": str(row.get("id", f"{path.name}:{no}")),
        "prompt": build_prompt(row, system_prompt),
        "answer": str(row["answer"]),
        "reference_steps": [s.strip() for s in row.get("reference_steps") or []],
        "reference_sets": row.get("reference_sets"),
        "choices": row.get("choices"),
        "source": str(row.get("source", "")),
        "difficulty": str(row.get("difficulty", "")),  # a label for evaluation breakdowns (data/demo has it)
        "images": [str(p) for p in image_paths(row, base)],
    }


class ImageLoader:
    """``datasets`` transform: open image files only when a batch is read.

    Images are checked at start-up, but a file can vanish or break during a long run. Such
    a row is skipped (like ``data.skip_invalid``): it is replaced by the next row whose
    images open, with one warning per row naming its ``file:line`` (``where``: image paths ->
    the row's place in the data) and a count, instead of crashing the run. The replacement
    depends on the row alone, so every generation of a prompt gets the same one.
    """

    def __init__(self, dataset: Dataset, where: Mapping[tuple, str] | None = None) -> None:
        self.raw = dataset.with_format(None)
        self.position = {tuple(p): i for i, p in reversed(list(enumerate(self.raw["images"])))}
        self.where = dict(where or {})
        self.skipped: set[tuple] = set()

    @staticmethod
    def of(dataset: Dataset) -> ImageLoader | None:
        """The loader a data set reads its images with (None: it has none)."""
        transform = (dataset.format.get("format_kwargs") or {}).get("transform")
        return transform if isinstance(transform, ImageLoader) else None

    def __call__(self, batch: dict) -> dict:
        if "images" not in batch:
            return batch
        out = {k: list(v) for k, v in batch.items()}
        for j, paths in enumerate(batch["images"]):
            try:
                out["images"][j] = _open_images(paths)
            except (OSError, ValueError) as err:
                row, images = self._replacement(tuple(paths), err)
                for k in out:
                    out[k][j] = images if k == "images" else row.get(k)
        return out

    def _skip(self, paths: tuple, err: Exception) -> None:
        if paths in self.skipped:
            return
        self.skipped.add(paths)
        where = self.where.get(paths, f"row {self.position.get(paths, '?')}")
        logger.warning("%s: the row's image is unreadable now (%s: %s); row skipped, the next readable row takes its "
                       "place (%d row(s) skipped so far)", where, type(err).__name__, err, len(self.skipped))

    def _replacement(self, paths: tuple, err: Exception) -> tuple[dict, list]:
        self._skip(paths, err)
        start = self.position.get(paths, 0)
        for k in range(1, len(self.raw) + 1):
            row = self.raw[(start + k) % len(self.raw)]
            try:
                return row, _open_images(row["images"])
            except (OSError, ValueError) as other:
                self._skip(tuple(row["images"]), other)
        raise DataError("no row's images can be read any more (were the image files removed?)")


def own_image_loader(ds: Dataset, where: Mapping[tuple, str] | None = None) -> Dataset:
    """``ds`` reading its images through an :class:`ImageLoader` of its own rows (``where``: the
    rows' places, default those of the loader it had). A split or selection otherwise shares its
    parent's loader, which could hand a validation row to training as a replacement, or the reverse."""
    loader = ImageLoader.of(ds)
    if where is None and loader is None:
        return ds
    return ds.with_transform(ImageLoader(ds, where if where is not None else loader.where))


def _open_images(paths: Sequence[str]) -> list:
    from PIL import Image

    return [Image.open(p).convert("RGB") for p in paths]


def load_split(source: str | Path, *, skip_invalid: bool = False, max_errors_shown: int = 20,
               system_prompt: str | None = None, limit: int | None = None, split: str = "train",
               columns: Mapping[str, str] | None = None, require_references: bool = True,
               skip_option: str | None = "data.skip_invalid: true") -> LoadedSplit:
    """Rows of one source (see :func:`locate`), each checked; ``skip_option`` is how the caller's
    user asks to drop bad ones (None: the caller has no such option)."""
    path = locate(source)
    columns = columns or {}
    base = path if path.is_dir() else path.parent
    records, places, errors, bad_rows = [], [], [], 0
    for no, row in read_rows(path, split, columns):
        problems = [_name_columns(p, columns) for p in row_problems(row, base, require_references)]
        if problems:
            errors.extend(f"{source}:{no}: {p}" for p in problems)
            bad_rows += 1
            continue
        records.append(_to_record(row, base, no, Path(str(source)), system_prompt))
        places.append(f"{source}:{no}")
    if errors and not skip_invalid:
        shown = "\n  ".join(errors[:max_errors_shown])
        more = f"\n  ... and {len(errors) - max_errors_shown} more" if len(errors) > max_errors_shown else ""
        hint = f"set {skip_option} to drop them" if skip_option else "fix or remove them"
        raise DataError(f"{bad_rows} invalid row(s) in {source} ({hint}):"
                        f"\n  {shown}{more}")
    if not records:
        raise DataError(f"{source}: no valid rows")
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
    from datasets import Dataset

    ds = Dataset.from_list(records)
    if has_images:
        where: dict[tuple, str] = {}
        for r, place in zip(records, places):
            where.setdefault(tuple(r["images"]), place)
        ds = own_image_loader(ds, where)
    return LoadedSplit(ds, bad_rows if skip_invalid else 0, str(source))


def load_datasets(data_cfg: DataSection, seed: int = 42) -> tuple[LoadedSplit, LoadedSplit | None]:
    """Train and validation splits from files, or validation held out from train."""
    opts = dict(skip_invalid=data_cfg.skip_invalid, max_errors_shown=data_cfg.max_errors_shown,
                system_prompt=data_cfg.system_prompt, columns=data_cfg.columns)
    train = load_split(data_cfg.train, limit=data_cfg.max_train_samples, split=data_cfg.train_split, **opts)
    if data_cfg.validation:
        return train, load_split(data_cfg.validation, split=data_cfg.validation_split, **opts)
    if data_cfg.validation_fraction <= 0:
        return train, None
    split = train.dataset.train_test_split(test_size=data_cfg.validation_fraction, seed=seed)
    return (LoadedSplit(own_image_loader(split["train"]), train.skipped, train.source),
            LoadedSplit(own_image_loader(split["test"]), 0, train.source + " (held out)"))


def context_length(model: Any) -> int | None:
    """The model's positions (``max_position_embeddings``, of its text model for a VLM), or None."""
    config = getattr(model, "config", None)
    for c in (config, getattr(config, "text_config", None)):
        n = getattr(c, "max_position_embeddings", None)
        if isinstance(n, int) and n > 0:
            return n
    return None


def limit_prompt_lengths(split: LoadedSplit, tokenizer: Any, room: int, mode: str, key: str,
                         chat_template_kwargs: Mapping[str, Any] | None = None) -> tuple[LoadedSplit, str | None]:
    """Prompts longer than ``room`` tokens (the context minus the completion's tokens), per
    ``data.long_prompts``: dropped, an error, or kept; returns the split and a warning line.
    Image tokens are not counted (their number depends on the processor's resizing)."""
    tok = getattr(tokenizer, "tokenizer", tokenizer)
    raw = split.dataset.with_format(None)
    prompts = raw["prompt"]
    texts = [prompt_text(tok, p, chat_template_kwargs) for p in prompts]
    lengths = [len(ids) for ids in tok(texts, add_special_tokens=False)["input_ids"]]
    long = [i for i, n in enumerate(lengths) if n > room]
    if not long:
        return split, None
    ids = ", ".join(str(raw[i]["id"]) for i in long[:5]) + (" ..." if len(long) > 5 else "")
    what = (f"{len(long)} of {len(prompts)} prompt(s) of {split.source} leave no room for {key}: longer than "
            f"{room} tokens (e.g. {ids})")
    if mode == "error":
        raise DataError(f"{what}; shorten them, or set data.long_prompts: skip")
    if mode == "keep":
        return split, f"{what}; kept (data.long_prompts: keep): their completions run past the model's context"
    dropped = set(long)
    keep = [i for i in range(len(prompts)) if i not in dropped]
    if not keep:
        raise DataError(f"{what}: none is left")
    return (LoadedSplit(own_image_loader(split.dataset.select(keep)), split.skipped, split.source),
            f"{what}; skipped (data.long_prompts: skip)")

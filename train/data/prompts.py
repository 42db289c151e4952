"""Rows into what a model reads and writes: the prompt, the target completion, the SFT records.

One rendering for every path (rollouts, the SFT phase, validation, evaluation, length
checks): :func:`build_prompt` (system instruction, question, options), :func:`prompt_text`
(the chat template with ``data.chat_template_kwargs``), :func:`render_target` (the JSON a
perfect policy writes), and the token lengths that warn when a limit cuts targets off.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from crystal_grpo.train.data.images import ImageLoader, image_paths, own_image_loader

if TYPE_CHECKING:
    from datasets import Dataset

SYSTEM_PROMPT = (
    "Solve the problem step by step. Reply with exactly one JSON object and nothing else: "
    '{"reasoning_steps": ["<step 1>", "<step 2>", "..."], "answer": "<final answer>"}. '
    "Each step is one short sentence. For multiple choice, answer with the option letter."
)


def build_prompt(row: dict, system_prompt: str | None = None) -> list[dict]:
    """Conversational prompt: system instruction, then the question (and options)."""
    text = row["question"].strip()
    if row.get("choices"):
        letters = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"
        text += "\nOptions: " + " ".join(f"({letters[i]}) {c}" for i, c in enumerate(row["choices"]))
    return [{"role": "system", "content": system_prompt or SYSTEM_PROMPT}, {"role": "user", "content": text}]


def render_target(row: Mapping[str, Any]) -> str:
    """The completion a perfect policy writes for a row (docs/method.md section 2): what the SFT warm
    start trains on and what the length check measures."""
    return json.dumps({"reasoning_steps": list(row["reference_steps"]), "answer": row["answer"]}, ensure_ascii=False)


def prompt_text(
    processing_class: Any, messages: list[dict], chat_template_kwargs: Mapping[str, Any] | None = None
) -> str:
    """A conversational prompt rendered for generation: the one rendering every path uses
    (validation, evaluation, the SFT phase, length checks), with the run's
    ``data.chat_template_kwargs`` as TRL's rollouts use them."""
    return processing_class.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=False, **(chat_template_kwargs or {})
    )


def encode_example(
    tokenizer: Any, row: Mapping[str, Any], chat_template_kwargs: Mapping[str, Any] | None = None
) -> tuple[list[int], list[int]]:
    """A row's prompt tokens exactly as GRPO generates from them, and the target completion's
    tokens up to the end of the turn, tokenized APART: joined, a byte-level BPE may merge the
    prompt's last character with the target's first, and the model would learn a context it
    never sees when generating (TRL warns about that for prompt-completion data)."""
    tok = getattr(tokenizer, "tokenizer", tokenizer)
    prompt = prompt_text(tok, row["prompt"], chat_template_kwargs)
    target = render_target(row)
    full = tok.apply_chat_template(
        [*row["prompt"], {"role": "assistant", "content": target}], tokenize=False, **(chat_template_kwargs or {})
    )
    completion = full[len(prompt) :] if full.startswith(prompt) else target + (tok.eos_token or "")
    if tok.eos_token and tok.eos_token in completion:  # generation stops there
        completion = completion[: completion.index(tok.eos_token) + len(tok.eos_token)]
    return (tok(prompt, add_special_tokens=False)["input_ids"], tok(completion, add_special_tokens=False)["input_ids"])


def sft_dataset(ds: Dataset, processing_class: Any, chat_template_kwargs: Mapping[str, Any] | None = None) -> Dataset:
    """Rows for TRL's SFTTrainer with the loss on the target only: text rows pre-tokenized
    (``input_ids`` and ``labels``, -100 on the prompt; :func:`encode_example`), rows with
    images as prompt-completion messages (TRL's vision collator tokenizes the two apart)."""
    raw = ds.with_format(None)  # the image paths, not the loading transform
    if "images" in raw.column_names:
        extra = {"chat_template_kwargs": dict(chat_template_kwargs)} if chat_template_kwargs else {}  # TRL's column
        out = raw.map(
            lambda r: {"completion": [{"role": "assistant", "content": render_target(r)}], **extra},
            remove_columns=[c for c in raw.column_names if c not in ("prompt", "images")],
        )
        loader = ImageLoader.of(ds)
        return own_image_loader(out, loader.where if loader else {})

    def encode(row: dict) -> dict:
        prompt, completion = encode_example(processing_class, row, chat_template_kwargs)
        return {"input_ids": prompt + completion, "labels": [-100] * len(prompt) + completion}

    return raw.map(encode, remove_columns=raw.column_names)


#: Share of the targets a length limit may cut off before the run warns (no silent truncation).
MAX_TRUNCATED_SHARE = 0.05


def target_lengths(
    tokenizer: Any,
    rows: Sequence[Mapping[str, Any]],
    with_prompt: bool = False,
    chat_template_kwargs: Mapping[str, Any] | None = None,
) -> list[int]:
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
    return (
        f"{key}={limit} cuts off {over:.0%} of the reference answers rendered as the target JSON "
        f"(tokens: mean {sum(lengths) / len(lengths):.0f}, p95 {p95}, max {ordered[-1]}); a completion "
        f"that long fails the format check. Raise it to at least {p95}."
    )


def to_record(row: dict, base: Path, no: int, path: Path, system_prompt: str | None) -> dict:
    """What a split holds for a checked row: the prompt as GRPO renders it, the reference fields
    the rewards read, the image paths (``id`` defaults to ``file:N``)."""
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

"""Parse a policy completion into reasoning steps and an answer (docs/method.md section 2).

The policy must answer with one JSON object
``{"reasoning_steps": ["...", "..."], "answer": "..."}``. ``parse_completion`` reports
whether a completion follows that format exactly (the format indicator F) and, even when
it does not, extracts steps and answer leniently so they can still be scored. It runs
on every sampled completion inside the reward, so it must never raise on any input.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

from crystal_grpo.rewards.text import clean_text

# Bounds on the lenient scan, so a huge junk completion costs linear time at most.
MAX_SCAN_CHARS = 200_000
MAX_SCAN_STARTS = 20

_FENCE = "```"
_DECODER = json.JSONDecoder()


def _reject_constant(name: str) -> Any:
    """json hook: NaN / Infinity are not JSON, so they fail the strict format check."""
    raise ValueError(f"non-standard JSON constant {name}")


_STRICT_DECODER = json.JSONDecoder(parse_constant=_reject_constant)


@dataclass(frozen=True)
class ParsedOutput:
    """What a completion says: its steps (stripped, non-empty), its answer, and F."""

    steps: list[str] = field(default_factory=list)
    answer: str | None = None
    format_ok: bool = False


def _is_number(value: Any) -> bool:
    """True for JSON numbers; bool is an int subclass in Python but not a number here."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _content_text(content: Any) -> str:
    """Text of one message's content: a str, or a list of parts like {"type": "text", "text": ...}."""
    if isinstance(content, str):
        return content
    if isinstance(content, (list, tuple)):
        parts = []
        for part in content:
            if isinstance(part, str):
                parts.append(part)
            elif isinstance(part, dict) and isinstance(part.get("text"), str):
                parts.append(part["text"])
        return "".join(parts)
    return ""


def _completion_text(completion: Any) -> str:
    """The assistant text of a completion: plain str, bytes, or TRL's list of message dicts.

    In the conversational form the assistant messages are joined (messages without a role
    count too); anything else is junk and reads as empty text.
    """
    if isinstance(completion, str):
        return completion
    if isinstance(completion, (bytes, bytearray)):
        return bytes(completion).decode("utf-8", errors="replace")
    if isinstance(completion, dict):
        completion = [completion]
    if isinstance(completion, (list, tuple)):
        messages = [m for m in completion if isinstance(m, dict)]
        return "\n".join(
            _content_text(m.get("content")) for m in messages if m.get("role", "assistant") == "assistant"
        )
    return ""


def prompt_text(prompt: Any) -> str:
    """The question as the model saw it: a text prompt itself, or the text of a conversation's last
    message (its text parts, with a multimodal message)."""
    if isinstance(prompt, (list, tuple)):
        prompt = prompt[-1].get("content", "") if prompt and isinstance(prompt[-1], dict) else ""
    if isinstance(prompt, str):
        return prompt
    if not isinstance(prompt, (list, tuple)):
        return ""
    return " ".join(p.get("text", "") for p in prompt if isinstance(p, dict) and p.get("type") == "text")


def _number_text(value: int | float) -> str | None:
    """str of a number; None for an int too long for str() (over 4,300 digits)."""
    try:
        return str(value)
    except ValueError:
        return None


def clean_steps(steps: list[Any]) -> list[str]:
    """String (or number) items, stripped and encodable (lone surrogates -> U+FFFD), empty ones dropped."""
    out = []
    for step in steps:
        if _is_number(step):
            step = _number_text(step)
        if isinstance(step, str) and step.strip():
            out.append(clean_text(step.strip()))
    return out


def _clean_answer(answer: Any) -> str | None:
    """A str answer stripped and encodable (empty -> None); a finite number as its str (12 -> "12")."""
    if isinstance(answer, str):
        return clean_text(answer.strip()) or None
    if _is_number(answer) and (isinstance(answer, int) or math.isfinite(answer)):
        return _number_text(answer)  # (math.isfinite overflows on ints past float range)
    return None


def _from_object(obj: dict) -> tuple[list[str], str | None]:
    steps = obj.get("reasoning_steps")
    return (clean_steps(steps) if isinstance(steps, list) else []), _clean_answer(obj.get("answer"))


def _unfence(text: str) -> tuple[str, int]:
    """The body of at most one surrounding Markdown fence: ``` or ```json (any case), and where
    it starts in ``text``.

    String operations, not a regex: a lazy-body pattern backtracks cubically on "```"
    followed by a long whitespace run (docs/rewards.md, "Hostile model output"). The body is
    everything between the opening ``` (plus an optional "json" tag) and the closing ```;
    the caller strips it, so whitespace around the body needs no handling here.
    """
    if len(text) < 2 * len(_FENCE) or not (text.startswith(_FENCE) and text.endswith(_FENCE)):
        return text, 0
    body = text[len(_FENCE) : -len(_FENCE)]
    return (body[4:], len(_FENCE) + 4) if body[:4].casefold() == "json" else (body, len(_FENCE))


def _strict(text: str) -> tuple[dict | None, int]:
    """The object if the text is exactly the required JSON (optionally in one fence), else None;
    and where it starts in ``text``."""
    body, start = _unfence(text)
    try:
        obj = _STRICT_DECODER.decode(body.strip())
    except (ValueError, RecursionError):
        return None, 0
    if not isinstance(obj, dict):
        return None, 0
    steps, answer = obj.get("reasoning_steps"), obj.get("answer")
    if not (isinstance(steps, list) and all(isinstance(s, str) for s in steps)):
        return None, 0
    if not (isinstance(answer, str) or _is_number(answer)):
        return None, 0
    return obj, start + len(body) - len(body.lstrip())


def _first_object(text: str) -> tuple[dict | None, int]:
    """The first JSON object that decodes from one of the first few '{' positions, and that position."""
    text = text[:MAX_SCAN_CHARS]
    start = text.find("{")
    for _ in range(MAX_SCAN_STARTS):
        if start < 0:
            return None, 0
        try:
            obj, _end = _DECODER.raw_decode(text, start)
        except (ValueError, RecursionError):
            obj = None
        if isinstance(obj, dict):
            return obj, start
        start = text.find("{", start + 1)
    return None, 0


def locate_object(text: str) -> tuple[dict | None, int, bool]:
    """The JSON object :func:`parse_completion` reads in a completion's ``text``, the index in
    ``text`` where it starts (its ``{``), and F. (None, 0, False) when there is none; may raise
    on junk that :func:`parse_completion` survives."""
    stripped = text.strip()
    lead = len(text) - len(text.lstrip())
    obj, start = _strict(stripped)
    format_ok = obj is not None
    if obj is None:
        obj, start = _first_object(stripped)
    return obj, lead + start, format_ok


def parse_completion(completion: Any) -> ParsedOutput:
    """Steps, answer and format indicator of one completion; never raises.

    ``format_ok`` is the strict check of docs/method.md section 2; steps and answer come from the
    first JSON object in the text when the format is wrong, and are empty/None without one.
    """
    try:
        obj, _start, format_ok = locate_object(_completion_text(completion))
        if obj is None:
            return ParsedOutput([], None, False)
        steps, answer = _from_object(obj)
        return ParsedOutput(steps, answer, format_ok)
    except Exception:  # noqa: BLE001 - a reward input must never crash training
        return ParsedOutput([], None, False)

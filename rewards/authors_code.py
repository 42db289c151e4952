"""The reward the CRYSTAL authors' released training code trains with: NOT the paper's Eq. 7.

Their trainer (github.com/waybarrios/crystal: ``training/scripts/train_cpr.sh`` runs
``training/open_r1/grpo_rec.py``) sums three reward functions, unweighted: format and accuracy
(``Qwen2VLModule.format_reward_vqa`` / ``vqa_accuracy_reward``, their JSON extraction ported,
the judgement crystal-metrics' own) and crystal-metrics' ``causal_process_reward`` at 0.6/0.4
(called, not re-implemented). Each function, file by file: docs/rewards.md, "Rewards"
(``authors_code``). Validation still reports the project's metrics for this arm, so arms are
compared like with like; only the trained reward is theirs.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from crystal_grpo.rewards.base import Batch, RewardConfig, RewardModule, Scored
from crystal_grpo.rewards.parsing import ParsedOutput
from crystal_grpo.typed import option

if TYPE_CHECKING:
    import torch

_FENCE = re.compile(r"```json\s*|\s*```")


def _outermost_object(text: str) -> str | None:
    """The first balanced ``{...}`` span (their brace counting, which ignores strings)."""
    first = text.find("{")
    if first == -1:
        return None
    depth = 0
    for i in range(first, len(text)):
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth == 0:
            return text[first : i + 1]
    return None


def released_format(text: str) -> float:
    """``Qwen2VLModule.format_reward_vqa`` for one completion (their qwen_module.py)."""
    cleaned = _FENCE.sub("", text).strip()
    try:
        try:
            parsed = json.loads(cleaned)
        except json.JSONDecodeError:
            span = _outermost_object(cleaned)
            parsed = json.loads(re.sub(r",(\s*[\]}])", r"\1", span)) if span is not None else None
        steps = parsed.get("reasoning_steps") if isinstance(parsed, dict) else None
        ok = (
            isinstance(steps, list)
            and isinstance(parsed.get("answer"), str)
            and len(steps) > 0
            and all(isinstance(s, str) for s in steps)
        )
    except Exception:  # noqa: BLE001 - theirs: any failure scores 0
        ok = False
    return 1.0 if ok else 0.0


def released_answer(text: str) -> Any:
    """The answer ``Qwen2VLModule.vqa_accuracy_reward`` extracts, as it extracts it (their
    repairs included; falsy when there is none)."""
    cleaned = _FENCE.sub("", text).strip()
    try:
        parsed, span = None, None
        try:
            parsed = json.loads(cleaned)
            if "reasoning_steps" in parsed and "answer" in parsed:
                span = cleaned
        except Exception:  # noqa: BLE001 - theirs
            pass
        if parsed is None:
            span = _outermost_object(cleaned)
        if not span:
            return ""
        # (their "replace smart quotes" line replaces ASCII quotes by themselves in the released
        # file, a no-op, so smart quotes stay: crystal-metrics' own parser does replace them)
        span = re.sub(r"""(?<=[:,\[])\s*'([^']*)'(?=\s*[,\]\}])""", r' "\1"', span)
        span = re.sub(r'"\s*\n\s*"', '",\n    "', span)
        span = re.sub(r'"\s+(?=")', '", ', span)
        span = re.sub(r",(\s*[\]}])", r"\1", span)
        if parsed is None:
            try:
                parsed = json.loads(span)
            except json.JSONDecodeError:
                fixed = span.replace("'", '"')
                fixed = re.sub(r'"\s*\n\s*"', '",\n    "', fixed)
                fixed = re.sub(r'"\s+(?=")', '", ', fixed)
                parsed = json.loads(re.sub(r",(\s*[\]}])", r"\1", fixed))
        return parsed.get("answer", "") if parsed else ""
    except Exception:  # noqa: BLE001 - theirs: any failure scores 0
        return ""


def released_accuracy(text: str, truth: str, problem: str, judge: Any) -> float:
    """``Qwen2VLModule.vqa_accuracy_reward`` for one completion: the judge's confidence when the
    extracted answer is correct, else 0 (any failure: 0)."""
    answer = released_answer(text)
    if not answer:
        return 0.0
    try:
        result = judge.evaluate_single(problem, answer, truth)
    except Exception:  # noqa: BLE001 - theirs
        return 0.0
    return float(result.confidence) if result.is_correct else 0.0


@dataclass
class AuthorsCodeConfig(RewardConfig):
    """The released weights (their plain-CPR run: 0.6 / 0.4)."""

    answer_weight: float = option(0.6, "CPR answer weight (their train_cpr.sh: 0.6).", weight=True)
    step_weight: float = option(0.4, "CPR step weight (their train_cpr.sh: 0.4).", weight=True)
    verbosity_guard: bool | None = option(False, "Their trainer has none.")


def _text(completion: Any) -> str:
    """A completion as the released functions see it (``completion[0]["content"]``)."""
    if isinstance(completion, ParsedOutput):  # evaluation from given steps and answer
        return json.dumps({"reasoning_steps": completion.steps, "answer": completion.answer or ""})
    if isinstance(completion, str):
        return completion
    try:
        return str(completion[-1]["content"])
    except (KeyError, IndexError, TypeError):
        return str(completion)


def _as_text(value: Any) -> str:
    """``str(value)``, or '' where Python refuses (an integer past 4,300 digits in a data cell)."""
    try:
        return str(value)
    except ValueError:
        return ""


def _problem(row: Mapping[str, Any]) -> str:
    """The question text their accuracy judge reads (the options matter for letter answers)."""
    prompt = row.get("prompt")
    if isinstance(prompt, list) and prompt and isinstance(prompt[-1], Mapping):
        content = prompt[-1].get("content")
        if isinstance(content, str):
            return content
        if isinstance(content, list):
            return " ".join(str(p.get("text", "")) for p in content if isinstance(p, Mapping))
    choices = row.get("choices") or []
    return "Options: " + " ".join(f"({chr(65 + i)}) {c}" for i, c in enumerate(choices)) if choices else ""


class AuthorsCodeReward(RewardModule):
    """format + accuracy + CPR, summed, exactly as the released trainer computes them."""

    name = "authors_code"
    objectives = {
        "authors_code_format": "accuracy",
        "authors_code_accuracy": "accuracy",
        "authors_code_cpr": "reasoning",
    }
    extra_fields = ("authors_code_format", "authors_code_accuracy", "authors_code_cpr")
    outcome_component = "authors_code_accuracy"
    uses_steps = False  # their reward needs no encoder; validation still embeds steps for Match F1
    config_class = AuthorsCodeConfig
    config: AuthorsCodeConfig

    def score(
        self, completions: Sequence[Any], rows: Sequence[Mapping[str, Any]], with_steps: bool | None = None
    ) -> Scored:
        from crystal_metrics.accuracy import AccuracyCalculator  # crystal-metrics itself, not a copy
        from crystal_metrics.rewards import causal_process_reward

        scored = super().score(completions, rows, with_steps)
        texts = [_text(c) for c in completions]
        rows = [r if isinstance(r, Mapping) else {} for r in rows]
        truths = [_as_text(r.get("answer", "")) for r in rows]
        judge = AccuracyCalculator()
        accuracy = [released_accuracy(t, truth, _problem(r), judge) for t, truth, r in zip(texts, truths, rows)]
        try:  # their vqa_causal_reasoning_reward: any failure scores the whole batch 0
            cpr = causal_process_reward(
                [[{"content": t}] for t in texts],
                ground_truths=truths,
                reference_steps=[list(r.get("reference_steps") or []) for r in rows],
                answer_weight=self.config.answer_weight,
                step_weight=self.config.step_weight,
            )
        except Exception:  # noqa: BLE001
            cpr = [0.0] * len(texts)
        scored.batch.extra = (
            scored.batch.correct.new_tensor(  # float64, like the batch
                [[released_format(t) for t in texts], accuracy, cpr]
            )
            .reshape(3, len(texts))
            .T
        )
        return scored

    def outcome(self, batch: Batch) -> torch.Tensor:
        """Their accuracy reward's correctness: its confidence (1.0 exact, 0.9-0.95 within their
        tolerance) above 0."""
        return (batch.extra[:, self.extra_fields.index(self.outcome_component)] > 0).double()

    def components(self, batch: Batch) -> dict[str, torch.Tensor]:
        return {name: batch.extra[:, i] for i, name in enumerate(self.extra_fields)}

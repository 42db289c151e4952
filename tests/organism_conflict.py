"""A reasoning reward built to conflict with accuracy (tests/test_learning.py): it pays a *wrong*
answer on the organism's questions whose start value is odd (about half of them), nothing
elsewhere. Summed with answer-only's reward it pulls accuracy down; PCGrad must project it."""

import json


def _text(completion) -> str:
    if isinstance(completion, list):  # conversational: the assistant's message
        return completion[-1].get("content", "") if completion else ""
    return completion if isinstance(completion, str) else str(completion)


def wrong_on_odd(completions, answer, reference_steps, **columns) -> list[float]:
    out = []
    for completion, truth, refs in zip(completions, answer, reference_steps):
        try:
            predicted = str(json.loads(_text(completion)).get("answer", "")).strip()
        except (ValueError, AttributeError):
            predicted = None
        start = int(refs[0].split()[2])  # "b = 9 + 3 = 2": the start value
        out.append(1.0 if start % 2 == 1 and predicted is not None and predicted != str(truth) else 0.0)
    return out

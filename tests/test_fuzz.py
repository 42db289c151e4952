"""Property tests: nothing a model can emit (or a data file can hold) crashes a reward.

Text strategies include lone surrogates explicitly: hypothesis' default text strategy
leaves out category Cs, which is exactly what a JSON escape like "\\ud800" produces.
Every test fixes max_examples, deadline=None and derandomize=True, so the run is the
same on every machine and fits in CI on 2 cores.
"""

from __future__ import annotations

import json
import math
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from crystal_grpo.rewards import build_reward
from crystal_grpo.rewards.answer_only import FormatReward
from crystal_grpo.rewards.answers import answers_match
from crystal_grpo.rewards.base import Batch
from crystal_grpo.rewards.parsing import ParsedOutput, parse_completion
from crystal_grpo.train.data.splits import row_problems
from crystal_grpo.train.tools.fuzz_rewards import MIXED, SHAPES, format_table, fuzz, hostile_batches

from conftest import encodable

FAST = settings(deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])

# --- strategies --------------------------------------------------------------------

# .map(str) keeps hypothesis from merging the character strategies into one, which
# silently drops category Cs again (a plain union never yields a surrogate).
any_char = st.one_of(
    st.characters(exclude_categories=()),
    st.characters(categories=["Cs"]).map(str),  # lone surrogates, often
    st.sampled_from(list('{}[]",:`\\ \t\n$-+.%()*_\x00\u2212\uff11')),
)
any_text = st.text(alphabet=any_char, max_size=120)
numbers = (
    st.integers() | st.integers(min_value=10**300, max_value=10**400) | st.floats(allow_nan=True, allow_infinity=True)
)
json_leaves = st.none() | st.booleans() | numbers | any_text
json_values = st.recursive(
    json_leaves, lambda c: st.lists(c, max_size=4) | st.dictionaries(any_text, c, max_size=4), max_leaves=12
)


@st.composite
def near_json(draw) -> str:
    """A completion built like the required object (often exactly), then maybe fenced, padded
    or truncated."""
    if draw(st.booleans()):  # the required types: string steps, a string or number answer
        obj = {"reasoning_steps": draw(st.lists(any_text, max_size=6)), "answer": draw(any_text | numbers)}
    else:
        steps = draw(st.lists(any_text | numbers | json_values, max_size=6))
        obj = {"reasoning_steps": steps if draw(st.booleans()) else draw(json_values), "answer": draw(json_values)}
    text = json.dumps(obj, ensure_ascii=draw(st.booleans()))  # escapes or raw surrogates
    text = draw(st.sampled_from(["{}", "```json\n{}\n```", "```{}```", "Sure: {} done", "  {}\n", "[{}]"])).format(
        text
    )
    if draw(st.booleans()):
        text = text[: draw(st.integers(0, len(text)))]
    return text


completions = st.one_of(
    near_json(),
    any_text,
    st.lists(
        st.fixed_dictionaries({"role": st.sampled_from(["assistant", "user"]), "content": near_json() | json_values}),
        max_size=2,
    ),
    json_values,
)


# --- parsing and answers -------------------------------------------------------------


@settings(FAST, max_examples=400)
@given(completions)
def test_parse_completion_is_total_and_returns_clean_strings(completion):
    out = parse_completion(completion)
    assert isinstance(out, ParsedOutput)
    assert isinstance(out.steps, list) and all(isinstance(s, str) and s and encodable(s) for s in out.steps)
    assert out.answer is None or (isinstance(out.answer, str) and out.answer and encodable(out.answer))
    assert isinstance(out.format_ok, bool)


@settings(FAST, max_examples=400)
@given(json_values | near_json(), json_values, st.none() | st.lists(json_leaves, max_size=5))
def test_answers_match_is_total(predicted, truth, choices):
    assert answers_match(predicted, truth, choices) in (True, False)


# --- every reward module -------------------------------------------------------------

MODULES = {
    name: build_reward(name, encoder="packaged:all-MiniLM-L6-v2", device="cpu")
    for name in ("format", "answer_only", "composite", "cpr", "authors_code")
}
reference_chains = st.none() | st.lists(any_text, max_size=3) | st.just(["Tom has 12 pencils.", "So 12."])


@settings(FAST, max_examples=100)
@given(
    st.lists(completions, min_size=1, max_size=4),
    json_values,
    reference_chains,
    st.none() | st.lists(json_leaves, max_size=4),
)
def test_every_reward_returns_one_finite_float_or_none_per_completion(comps, truth, refs, choices):
    n = len(comps)
    for module in MODULES.values():
        for f in module.reward_funcs():
            out = f(
                prompts=[""] * n,
                completions=comps,
                answer=[truth] * n,
                reference_steps=[refs] * n,
                choices=[choices] * n,
            )
            assert isinstance(out, list) and len(out) == n
            assert all(v is None or (isinstance(v, float) and math.isfinite(v)) for v in out), out


# --- data rows -----------------------------------------------------------------------

BASE = Path(tempfile.mkdtemp(prefix="fuzz-rows-"))
FIELDS = ["id", "question", "answer", "reference_steps", "reference_sets", "choices", "image", "images", "source"]
rows = json_values | st.dictionaries(st.sampled_from(FIELDS) | any_text, json_values, max_size=8)


@settings(FAST, max_examples=300)
@given(rows)
def test_row_problems_never_raises(row):
    problems = row_problems(row, BASE)
    assert isinstance(problems, list) and all(isinstance(p, str) for p in problems)
    if not isinstance(row, dict):
        assert problems


# --- the fuzz module behind scripts/fuzz_rewards.py ----------------------------------


def test_hostile_batches_cover_every_shape_and_count():
    batches = list(hostile_batches(2_000, seed=0, batch=8))
    assert sum(len(b.completions) for b in batches) == 2_000
    assert all(1 <= len(b.completions) <= 8 for b in batches)
    assert {b.shape for b in batches} == {*SHAPES, MIXED}
    texts = [c for b in batches for c in b.completions if isinstance(c, str)]
    assert any(any(0xD800 <= ord(ch) <= 0xDFFF for ch in t) or "\\ud" in t for t in texts)
    assert max(map(len, texts)) >= 100_000
    again = list(hostile_batches(2_000, seed=0, batch=8))
    assert [b.shape for b in again] == [b.shape for b in batches]  # seeded


@pytest.mark.slow
def test_fuzz_runner_finds_nothing_in_the_real_rewards():
    stats = fuzz(MODULES, n=400, seed=1, batch=8)
    for s in stats.values():
        assert s.completions == 400 and s.crashes == 0 and s.non_finite == 0, (s.name, s.first_error)
        assert s.slowest_s > 0 and s.slowest_shape in {*SHAPES, MIXED}
    table = format_table(stats).splitlines()
    assert table[0].split()[:4] == ["reward", "completions", "crashes", "non-finite"]
    assert [line.split()[0] for line in table[2:]] == list(MODULES)


class InfiniteFormat(FormatReward):
    """A broken reward: infinite for every completion without the format."""

    name = "infinite_format"

    def components(self, batch: Batch):
        return {"format": 1.0 / batch.format_ok}


class RaisingFormat(FormatReward):
    """A broken reward: raises on any batch holding an unparsable completion."""

    name = "raising_format"

    def components(self, batch: Batch):
        if not bool(batch.format_ok.all()):
            raise ValueError("cannot score this")
        return super().components(batch)


def test_fuzz_runner_counts_crashes_and_non_finite_rewards():
    stats = fuzz({"inf": InfiniteFormat(), "raise": RaisingFormat()}, n=200, seed=2, batch=8)
    assert stats["inf"].non_finite > 0 and stats["inf"].crashes == 0
    assert stats["raise"].crashes > 0 and "ValueError: cannot score this" in stats["raise"].first_error

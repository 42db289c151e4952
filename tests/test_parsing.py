"""Completion parsing (SPEC section 2): the strict format indicator and lenient extraction."""

from __future__ import annotations

import json
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rewards.parsing import ParsedOutput, parse_completion

GOOD = '{"reasoning_steps": ["Count the sheep.", "There are 12."], "answer": "12"}'
STEPS = ["Count the sheep.", "There are 12."]


@pytest.mark.parametrize(
    ("text", "steps", "answer"),
    [
        (GOOD, STEPS, "12"),
        (f"```json\n{GOOD}\n```", STEPS, "12"),
        (f"```JSON\n{GOOD}\n```", STEPS, "12"),
        (f"```\n{GOOD}\n```", STEPS, "12"),
        (f"```{GOOD}```", STEPS, "12"),
        (f"\n\n   {GOOD}  \n", STEPS, "12"),
        (f"  ```json\n  {GOOD}  \n```  ", STEPS, "12"),
        ('{"reasoning_steps": ["a"], "answer": "B", "confidence": 0.9}', ["a"], "B"),
        ('{"answer": 12, "reasoning_steps": ["a"]}', ["a"], "12"),
        ('{"reasoning_steps": ["a"], "answer": 12.5}', ["a"], "12.5"),
        ('{"reasoning_steps": ["a"], "answer": -3}', ["a"], "-3"),
        ('{"reasoning_steps": [], "answer": "yes"}', [], "yes"),
        ('{"reasoning_steps": ["  padded  ", "", "   ", "b"], "answer": " B "}', ["padded", "b"], "B"),
        ('{"reasoning_steps": ["a"], "answer": ""}', ["a"], None),
        ('{"reasoning_steps": ["\\u00e9t\\u00e9 \\u2212 1"], "answer": "x"}', ["\u00e9t\u00e9 \u2212 1"], "x"),
    ],
)
def test_strict_format(text, steps, answer):
    assert parse_completion(text) == ParsedOutput(steps, answer, True)


@pytest.mark.parametrize(
    ("text", "steps", "answer"),
    [
        # two fences: the body is not JSON; the first object is still read
        (f"```json\n{GOOD}\n```\n```json\n{GOOD}\n```", STEPS, "12"),
        # prose around the JSON
        (f"Sure! Here is my answer: {GOOD}", STEPS, "12"),
        (f"{GOOD}\nHope this helps.", STEPS, "12"),
        # a non-JSON code fence language
        (f"```python\n{GOOD}\n```", STEPS, "12"),
        # steps not a list
        ('{"reasoning_steps": "one long step", "answer": "B"}', [], "B"),
        # a non-string step: strict fails, lenient keeps strings and numbers
        ('{"reasoning_steps": ["a", 3, null, {"x": 1}, ["b"], true, " c "], "answer": "B"}', ["a", "3", "c"], "B"),
        # answer missing, bool, list, null, object, NaN
        ('{"reasoning_steps": ["a"]}', ["a"], None),
        ('{"reasoning_steps": ["a"], "answer": true}', ["a"], None),
        ('{"reasoning_steps": ["a"], "answer": ["B"]}', ["a"], None),
        ('{"reasoning_steps": ["a"], "answer": null}', ["a"], None),
        ('{"reasoning_steps": ["a"], "answer": {"value": 1}}', ["a"], None),
        ('{"reasoning_steps": ["a"], "answer": NaN}', ["a"], None),
        # steps missing
        ('{"answer": "B"}', [], "B"),
        # JSON array at top level: the object inside is found leniently
        (f"[{GOOD}]", STEPS, "12"),
        ('["a", "b"]', [], None),
        # truncated JSON: nothing decodes
        ('{"reasoning_steps": ["a", "b"], "answer": "1', [], None),
        # truncated outer object: the first complete object inside it is used
        ('{"reasoning_steps": ["a"], "meta": {"answer": "C"}, "answer": ', [], "C"),
        # single quotes are not JSON (and nothing is eval'd)
        ("{'reasoning_steps': ['a'], 'answer': 'B'}", [], None),
        # braces in prose before the object
        ("Let {x} be the count. " + GOOD, STEPS, "12"),
        # no JSON at all
        ("The answer is 12.", [], None),
        ("", [], None),
        ("   \n ", [], None),
    ],
)
def test_invalid_format_with_lenient_extraction(text, steps, answer):
    assert parse_completion(text) == ParsedOutput(steps, answer, False)


def test_conversational_form():
    msgs = [{"role": "assistant", "content": GOOD}]
    assert parse_completion(msgs) == ParsedOutput(STEPS, "12", True)
    parts = [{"role": "assistant", "content": [{"type": "text", "text": f"```json\n{GOOD[:30]}"},
                                               {"type": "image"}, {"type": "text", "text": f"{GOOD[30:]}\n```"}]}]
    assert parse_completion(parts) == ParsedOutput(STEPS, "12", True)
    prose = [{"role": "assistant", "content": f"Answer: {GOOD}"}]
    assert parse_completion(prose) == ParsedOutput(STEPS, "12", False)
    # other roles are ignored
    with_user = [{"role": "user", "content": "Q?"}, {"role": "assistant", "content": GOOD}]
    assert parse_completion(with_user) == ParsedOutput(STEPS, "12", True)
    assert parse_completion([{"role": "assistant", "content": None}]) == ParsedOutput([], None, False)
    assert parse_completion(GOOD.encode()) == ParsedOutput(STEPS, "12", True)


@pytest.mark.parametrize("junk", [None, 0, 3.5, True, [], {}, [[[]]], [None, 1], {"content": 5},
                                  b"\xff\xfe", object(), [{"role": "assistant", "content": [1, None, {"text": 2}]}]])
def test_junk_never_raises(junk):
    out = parse_completion(junk)
    assert out == ParsedOutput([], None, False)


def test_huge_inputs_are_bounded():
    deep = "[" * 100_000 + "]" * 100_000
    assert parse_completion(deep) == ParsedOutput([], None, False)
    nested = '{"a":' * 50_000 + "1" + "}" * 50_000
    assert parse_completion(nested).format_ok is False
    start = time.perf_counter()
    out = parse_completion('{"reasoning_steps": [' + '"x", ' * 10 + "{" * 2_000_000)
    assert out == ParsedOutput([], None, False)
    assert parse_completion("x" * 300_000 + GOOD) == ParsedOutput([], None, False)  # beyond the scan cap
    assert time.perf_counter() - start < 5.0


def test_output_is_frozen():
    out = parse_completion(GOOD)
    with pytest.raises(AttributeError):
        out.answer = "13"  # type: ignore[misc]


# --- fuzz --------------------------------------------------------------------------

json_leaves = st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20)
junk = st.recursive(
    json_leaves | st.binary(max_size=10),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=10), children, max_size=4),
    max_leaves=20,
)
message_like = st.lists(
    st.fixed_dictionaries({"role": st.sampled_from(["assistant", "user", "system"]), "content": junk}), max_size=3
)
json_ish = st.lists(
    st.sampled_from(['{', '}', '[', ']', '"', ':', ',', '"reasoning_steps"', '"answer"', '```', '```json\n',
                     '"x"', '12', 'true', 'null', 'NaN', ' ', '\n', '\\', 'B']) | st.text(max_size=5),
    max_size=30,
).map("".join)
valid = st.fixed_dictionaries(
    {"reasoning_steps": st.lists(st.text(max_size=15), max_size=5),
     "answer": st.text(max_size=10) | st.integers() | st.floats(allow_nan=False, allow_infinity=False)}
).map(json.dumps)


@settings(max_examples=300, deadline=None)
@given(st.one_of(junk, message_like, st.text(), json_ish, valid, valid.map(lambda s: f"```json\n{s}\n```")))
def test_fuzz_never_raises(completion):
    out = parse_completion(completion)
    assert isinstance(out, ParsedOutput)
    assert isinstance(out.steps, list) and all(isinstance(s, str) and s == s.strip() and s for s in out.steps)
    assert out.answer is None or isinstance(out.answer, str)
    assert isinstance(out.format_ok, bool)
    if out.format_ok:
        assert out.answer is None or out.answer == out.answer.strip()


@settings(max_examples=100, deadline=None)
@given(valid)
def test_fuzz_valid_objects_are_well_formed(text):
    obj = json.loads(text)
    out = parse_completion(text)
    assert out.format_ok
    assert out.steps == [s.strip() for s in obj["reasoning_steps"] if s.strip()]

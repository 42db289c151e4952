"""Completion parsing (docs/method.md section 2): the strict format indicator and lenient extraction."""

from __future__ import annotations

import json
import re
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from crystal_grpo.rewards.parsing import ParsedOutput, parse_completion

from conftest import encodable

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
    parts = [
        {
            "role": "assistant",
            "content": [
                {"type": "text", "text": f"```json\n{GOOD[:30]}"},
                {"type": "image"},
                {"type": "text", "text": f"{GOOD[30:]}\n```"},
            ],
        }
    ]
    assert parse_completion(parts) == ParsedOutput(STEPS, "12", True)
    prose = [{"role": "assistant", "content": f"Answer: {GOOD}"}]
    assert parse_completion(prose) == ParsedOutput(STEPS, "12", False)
    # other roles are ignored
    with_user = [{"role": "user", "content": "Q?"}, {"role": "assistant", "content": GOOD}]
    assert parse_completion(with_user) == ParsedOutput(STEPS, "12", True)
    assert parse_completion([{"role": "assistant", "content": None}]) == ParsedOutput([], None, False)
    assert parse_completion(GOOD.encode()) == ParsedOutput(STEPS, "12", True)


@pytest.mark.parametrize(
    "junk",
    [
        None,
        0,
        3.5,
        True,
        [],
        {},
        [[[]]],
        [None, 1],
        {"content": 5},
        b"\xff\xfe",
        object(),
        [{"role": "assistant", "content": [1, None, {"text": 2}]}],
    ],
)
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
    st.sampled_from(
        [
            "{",
            "}",
            "[",
            "]",
            '"',
            ":",
            ",",
            '"reasoning_steps"',
            '"answer"',
            "```",
            "```json\n",
            '"x"',
            "12",
            "true",
            "null",
            "NaN",
            " ",
            "\n",
            "\\",
            "B",
        ]
    )
    | st.text(max_size=5),
    max_size=30,
).map("".join)
valid = st.fixed_dictionaries(
    {
        "reasoning_steps": st.lists(st.text(max_size=15), max_size=5),
        "answer": st.text(max_size=10) | st.integers() | st.floats(allow_nan=False, allow_infinity=False),
    }
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


# --- text a tokenizer would reject -------------------------------------------------


@pytest.mark.parametrize(
    "text",
    [
        '{"reasoning_steps": ["\\ud800", "a \\ud83d b", "\\udfff"], "answer": "\\ud83d 12"}',  # JSON escapes
        '```json\n{"reasoning_steps": ["\ud800", "a \ud83d b", "\udfff"], "answer": "\ud83d 12"}\n```',  # raw
        'Sure: {"reasoning_steps": ["\\ud800", "a \\ud83d b", "\\udfff"], "answer": "\\ud83d 12"} \\ud800',
    ],
)
def test_lone_surrogates_come_out_replaced(text):
    out = parse_completion(text)
    assert out.steps == ["\ufffd", "a \ufffd b", "\ufffd"]
    assert out.answer == "\ufffd 12"
    assert out.format_ok is text.startswith(("{", "```"))
    assert all(encodable(s) for s in [*out.steps, out.answer])


def test_surrogate_pair_split_in_two_code_points_is_joined():
    out = parse_completion('{"reasoning_steps": ["smile \ud83d\ude00"], "answer": "\\ud83d\\ude00"}')
    assert out == ParsedOutput(["smile \U0001f600"], "\U0001f600", True)


def test_numbers_past_float_range_keep_the_object():
    # math.isfinite overflows on such ints; the whole parse used to fall back to "no object".
    big = "1" + "0" * 400
    out = parse_completion('{"reasoning_steps": ["a", ' + big + '], "answer": ' + big + "}")
    assert out == ParsedOutput(["a", big], big, False)  # a number step is not a string step
    assert parse_completion('{"reasoning_steps": ["a"], "answer": ' + big + "}") == ParsedOutput(["a"], big, True)


# --- linear time on hostile text ---------------------------------------------------

ADVERSARIAL = {
    # The old fence regex backtracked cubically: "```" + 4,000 spaces took 20 s.
    "fence + spaces": "```" + " " * 100_000 + "x",
    "fence + space/tab": "```" + " \t" * 50_000 + "x",
    "fence json + spaces + 2 backticks": "```json" + " " * 100_000 + "`` x",
    "fence + newlines": "```\n" + "\n \n" * 30_000 + "x```y",
    "fence + spaces, closed": "```" + " " * 100_000 + "```",
    "backticks": "`" * 100_000,
    "backtick pairs + spaces": "`` " * 30_000,
    "open braces": "{" * 100_000,
    "nested brackets": "[" * 50_000 + "]" * 50_000,
    "nested objects": '{"a":' * 20_000 + "1" + "}" * 20_000,
    "key runs": '{"reasoning_steps": [' + '"x", ' * 20_000,
}


@pytest.mark.parametrize("name", list(ADVERSARIAL))
def test_hostile_text_parses_in_linear_time(name):
    text = ADVERSARIAL[name]
    start = time.perf_counter()
    out = parse_completion(text)
    assert time.perf_counter() - start < 1.0, name
    assert isinstance(out, ParsedOutput) and out.answer is None and not out.format_ok


def test_fenced_object_with_long_padding_is_still_read():
    text = "```json" + " \t" * 20_000 + "\n" + GOOD + "\n" + " " * 20_000 + "```"
    start = time.perf_counter()
    assert parse_completion(text) == ParsedOutput(STEPS, "12", True)
    assert time.perf_counter() - start < 1.0


# The fence pattern parse_completion used before it was rewritten with string operations;
# on short inputs it is the reference for what counts as "at most one fence".
OLD_FENCE = re.compile(r"\A```(?:json)?[ \t]*\n?(.*?)\n?[ \t]*```\Z", re.DOTALL | re.IGNORECASE)


def old_strict_format(text: str) -> bool:
    text = text.strip()
    m = OLD_FENCE.match(text)
    body = (m.group(1) if m else text).strip()
    try:
        obj = json.loads(body, parse_constant=lambda c: (_ for _ in ()).throw(ValueError(c)))
    except (ValueError, RecursionError):
        return False
    return (
        isinstance(obj, dict)
        and isinstance(obj.get("reasoning_steps"), list)
        and all(isinstance(s, str) for s in obj["reasoning_steps"])
        and (
            isinstance(obj.get("answer"), str)
            or (isinstance(obj.get("answer"), (int, float)) and not isinstance(obj.get("answer"), bool))
        )
    )


fence_pieces = st.lists(
    st.sampled_from(
        ["```", "`", "``", "json", "JSON", "Json", "jſon", " ", "\t", "\n", "\r\n", GOOD, '{"a": 1}', "x", "{", "}"]
    ),
    max_size=8,
).map("".join)


@settings(max_examples=400, deadline=None, derandomize=True)
@given(fence_pieces)
def test_fence_handling_matches_the_old_pattern(text):
    assert parse_completion(text).format_ok is old_strict_format(text)

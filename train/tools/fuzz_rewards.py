"""Hostile completions and a runner that feeds them to every reward module (``scripts/fuzz_rewards.py``).

A reward runs on every sampled completion, so it must return one finite number (or None) per
completion, whatever the policy writes, and quickly. ``hostile_batches`` draws completions in
many hostile shapes (near-JSON, truncation, lone surrogates, huge or non-finite numbers, deep
nesting, long whitespace runs, control characters, thousands of steps, random unicode, ...);
``fuzz`` calls each reward module on them the way TRL does and counts crashes, non-finite
rewards and time. Step texts come mostly from a fixed pool (``STEP_POOL``, the hostile step
strings included), so the scorer's embedding cache hits and a run spends its time in parsing,
answer checks and matching rather than re-encoding.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from crystal_grpo.rewards import build_reward
from crystal_grpo.rewards.base import RewardFunctionError
from crystal_grpo.rewards.encoder import PACKAGED_MINILM

# --- the pools ---------------------------------------------------------------------

_NORMAL_STEPS = [
    "Tom buys 3 packs of 4 pencils, so he has 3 * 4 = 12 pencils.",
    "He gives 5 pencils to Ann, so 12 - 5 = 7 pencils are left.",
    "Then he buys 2 more, so 7 + 2 = 9 pencils.",
    "The answer is 9.",
    "The image shows a magnet attracting an iron nail.",
    "Opposite poles attract, so the magnets pull together.",
    "Option B names the north pole.",
    "Therefore the answer is B.",
    "The sign in the picture reads 'STOP'.",
    "Count the sheep in the field: there are twelve.",
    "Half of 50 is 25, i.e. 50%.",
    "The area is 3 m x 4 m = 12 m^2.",
    "Water boils at 100 degrees Celsius at sea level.",
    "So the final result is $1,234.50.",
    "Photosynthesis turns sunlight into chemical energy.",
    "Yes, the statement is true.",
    "Look at the second row of the table.",
    "Subtract the smaller number from the larger one.",
]
_UNICODE_STEPS = [
    "\u0661\u0662 \u0966\u0967 \uff11\uff12",
    "\u216b \u00bd \u00b2",
    "\u4e00\u4e8c\u4e09",
    "\U0001f600" * 50,
    "\u0301" * 200,
    "\u00e9t\u00e9 \u2212 1",
]
_LONG_STEPS = [
    "a" + " " * 20_000 + "b",
    "\t \n" * 5_000,
    "word " * 20_000,
    "x" * 100_000,
    "answer: " + " " * 3_000 + "B",
    "$" + " " * 5_000 + "12",
    "per" + " " * 5_000 + "cent",
    "1 " * 3_000,
    "`" * 20_000,
    "{" * 20_000,
]
_HOSTILE_STEPS = [
    "\ud800",
    "\udfff",
    "a \ud83d b",
    "\ud83d\ude00 smile",
    "\ufffd",
    "\x00",
    "\x00\x01\x02\x7f",
    "\x1b[31mred\x1b[0m",
    "\u200b\u200c\u200d",
    "\ufeffBOM",
    "\u202eright-to-left",
    "\r\n\t",
    "`" * 500,
    "```json",
    "{",
    "}",
    "[[[[",
    '"',
    "\\",
    "\\u",
    "NaN",
    "Infinity",
    "-1e999",
    "9" * 5000,
    "(B)",
    "**B**",
    "\u201cB\u201d",
    *_UNICODE_STEPS,
    *_LONG_STEPS,
]
STEP_POOL: list[str] = _NORMAL_STEPS + _HOSTILE_STEPS
REFERENCE_POOL: list[list[str]] = [
    _NORMAL_STEPS[0:4],
    _NORMAL_STEPS[4:8],
    _NORMAL_STEPS[8:12],
    _NORMAL_STEPS[12:18],
    ["A single reference step."],
    ["\ud800 a reference with a lone surrogate", "step two"],
]
TRUTHS = ["9", "12", "B", "A", "yes", "no", "Paris", "3/4", "50%", "-3", "1,234.5", "0.5", "STOP", "twelve"]
CHOICES = [None, None, ["10 apples", "12 apples", "14 apples", "Paris"], ["north", "south"]]

_LETTER_FORMS = [
    "{}",
    "({})",
    "{}.",
    "{})",
    "option {}",
    "Option ({})",
    "the answer is {}",
    "Answer: {}",
    "\u201c{}\u201d",
    "\u2018{}\u2019",
    '"{}"',
    "'{}'",
    "[{}]",
    "{{{}}}",
    "<{}>",
    "\u300c{}\u300d",
    "\u3010{}\u3011",
    "\uff08{}\uff09",
    "**{}**",
    "*{}*",
    "`{}`",
    "__{}__",
    "({}).",
    "**({})**",
    "Answer: [{}]",
    "option \u201c{}\u201d",
    "{} 12 apples",
    "({}) Paris",
    "[[{}]]",
    "{}?",
]
_NUMBER_FORMS = [
    "{}",
    "{}.0",
    "${}",
    "\u20ac{}",
    "{} sheep",
    "{}km",
    "The answer is {}.",
    "-{}",
    "\u2212{}",
    "{},000",
    "{}/4",
    "{}%",
    "{} percent",
    "{} per cent",
    "{}e3",
    ".{}",
    "{} apples and 4 pears",
    "$ {}",
    "- $ {}",
    "{} / 2",
    "\uff11\uff12",
    "\u0661\u0662",
    "\u00bd",
    "1,2345",
    "1-2",
    "{}" + "0" * 400,
    "\u00a3  {}",
    "+{}",
    "{}" + " " * 2_000 + "%",
]


# --- the shapes ----------------------------------------------------------------------


def _rand_text(rng: random.Random, max_len: int = 40) -> str:
    """Random unicode: mostly ASCII, some of every plane, lone surrogates included."""
    out = []
    for _ in range(rng.randint(0, max_len)):
        r = rng.random()
        if r < 0.6:
            out.append(chr(rng.randint(32, 126)))
        elif r < 0.7:
            out.append(chr(rng.randint(0xD800, 0xDFFF)))
        elif r < 0.8:
            out.append(chr(rng.randint(0, 31)))
        else:
            out.append(chr(rng.randint(0, 0x10FFFF)))
    return "".join(out)


def _step(rng: random.Random) -> Any:
    """A step: usually from the pool, sometimes fresh text, a number or junk."""
    r = rng.random()
    if r < 0.94:
        return rng.choice(STEP_POOL)
    if r < 0.96:
        return _rand_text(rng)
    return rng.choice([12, -3.5, 1e308, None, True, [], {"step": "nested"}, ["a"], "", "   "])


def _answer(rng: random.Random, truth: str) -> Any:
    r = rng.random()
    if r < 0.3:
        return truth
    if r < 0.5:
        return rng.choice(_LETTER_FORMS).format(rng.choice("ABCDb"))
    if r < 0.7:
        return rng.choice(_NUMBER_FORMS).format(rng.choice(["9", "12", "3", "50", "1,234"]))
    if r < 0.8:
        return rng.choice([12, 9, -3, 0.5, 1e308, 10**40, True, None, [], {"a": 1}, ["B"]])
    return _rand_text(rng, 60)


def _obj(rng: random.Random, truth: str, n_steps: int | None = None) -> dict:
    n = rng.choice([0, 1, 2, 3, 4, 5, 6, 8, 12]) if n_steps is None else n_steps
    return {"reasoning_steps": [_step(rng) for _ in range(n)], "answer": _answer(rng, truth)}


def _dumps(rng: random.Random, obj: Any) -> str:
    """JSON text, sometimes with non-ASCII escaped (so surrogates arrive as \\ud800 escapes)."""
    return json.dumps(obj, ensure_ascii=rng.random() < 0.5)


def _valid(rng, truth):
    return _dumps(rng, _obj(rng, truth))


def _fenced(rng, truth):
    open_ = rng.choice(["```json\n", "```JSON\n", "```\n", "```", "```json ", "  ```json\n\n"])
    return open_ + _dumps(rng, _obj(rng, truth)) + rng.choice(["\n```", "```", "\n```\n  ", "\n``", ""])


def _near_json(rng, truth):
    text = _dumps(rng, _obj(rng, truth))
    edits = [
        lambda t: t.replace('"', "'"),
        lambda t: t[:-1] + ",}",
        lambda t: t[:-1],
        lambda t: "Sure! Here it is: " + t + " Hope this helps.",
        lambda t: t.replace(":", "=", 1),
        lambda t: t + t,
        lambda t: "{" + t,
        lambda t: t.replace("]", "", 1),
        lambda t: "[" + t + "]",
        lambda t: t.replace('"answer"', '"Answer"'),
        lambda t: "// comment\n" + t,
        lambda t: (lambda i: t[:i] + rng.choice('{}[]",:\\') + t[i:])(rng.randrange(len(t) + 1)),
    ]
    return rng.choice(edits)(text)


def _truncated(rng, truth):
    text = _dumps(rng, _obj(rng, truth))
    return text[: rng.randrange(len(text) + 1)]


def _surrogates(rng, truth):
    lone = [chr(rng.randint(0xD800, 0xDFFF)) for _ in range(3)]
    obj = {
        "reasoning_steps": [lone[0], "step " + lone[1], rng.choice(STEP_POOL)],
        "answer": rng.choice([truth + lone[2], lone[2] + " " + truth, lone[2]]),
    }
    text = _dumps(rng, obj)
    return rng.choice([text, lone[0] + text, text + lone[1], "```json\n" + text + "\n```" + lone[2]])


def _numbers(rng, truth):
    literal = rng.choice(
        [
            "NaN",
            "Infinity",
            "-Infinity",
            "1e999",
            "-1e999",
            "1" + "0" * 400,
            "9" * 5_000,
            "1e-999",
            "0.1e400",
            "123456789012345678901234567890",
            "-0",
        ]
    )
    steps = '["a step", ' + literal + "]" if rng.random() < 0.5 else '["a step"]'
    return '{"reasoning_steps": ' + steps + ', "answer": ' + literal + "}"


def _deep(rng, truth):
    d = rng.choice([50, 1_000, 5_000, 50_000])
    return rng.choice(
        [
            "[" * d + "]" * d,
            '{"a":' * d + "1" + "}" * d,
            '{"reasoning_steps": ' + "[" * d + '"x"' + "]" * d + ', "answer": "9"}',
            '{"reasoning_steps": ["a"], "answer": ' + "[" * d + "]" * d + "}",
            "{" * d,
        ]
    )


def _whitespace(rng, truth):
    n = rng.choice([1_000, 20_000, 100_000])
    ws = rng.choice([" ", "\t", " \t", "\n", "\u00a0", "\u3000", "\r\n"])
    return rng.choice(
        [
            "```" + ws * n + "x",
            "```json" + ws * n + "`` x",
            _dumps(rng, {"reasoning_steps": ["a"], "answer": "a" + ws * n + "b"}),
            _dumps(rng, {"reasoning_steps": ["a"], "answer": "$" + ws * n + truth}),
            _dumps(rng, {"reasoning_steps": ["a"], "answer": "9 per" + ws * n + "x"}),
            _dumps(rng, {"reasoning_steps": ["a"], "answer": "option" + ws * n + "!"}),
            ws * n + _dumps(rng, _obj(rng, truth)) + ws * n,
        ]
    )


def _backticks(rng, truth):
    n = rng.choice([10, 1_000, 20_000, 100_000])
    return rng.choice(
        [
            "`" * n,
            "`` " * (n // 3),
            "```" * (n // 3) + _dumps(rng, _obj(rng, truth)),
            "```json\n" + _dumps(rng, _obj(rng, truth)) + "\n" + "`" * n,
        ]
    )


def _unicode(rng, truth):
    answer = rng.choice(
        [
            "\u0661\u0662",
            "\uff11\uff12",
            "\u216b",
            "\u4e00\u4e8c",
            "\u00bd",
            "\u00b9\u00b2",
            "\uff22",
            "\u0392",
            "\u0411",
            "\u05d1",
            "\u00e9t\u00e9",
            "\U0001d401",
            "\u2474",
        ]
    )
    return _dumps(rng, {"reasoning_steps": [rng.choice(_UNICODE_STEPS)], "answer": answer})


def _control(rng, truth):
    junk = "".join(chr(rng.randint(0, 31)) for _ in range(rng.randint(1, 50)))
    return rng.choice(
        [junk, junk + _dumps(rng, _obj(rng, truth)), _dumps(rng, {"reasoning_steps": [junk], "answer": truth + junk})]
    )


def _long_steps(rng, truth):
    return _dumps(
        rng,
        {
            "reasoning_steps": [rng.choice(_LONG_STEPS) for _ in range(rng.randint(1, 4))],
            "answer": _answer(rng, truth),
        },
    )


def _many_steps(rng, truth):
    n = rng.choice([100, 256, 257, 1_000, 5_000])
    return _dumps(rng, {"reasoning_steps": [rng.choice(_NORMAL_STEPS) for _ in range(n)], "answer": truth})


def _letters(rng, truth):
    return _dumps(
        rng,
        {
            "reasoning_steps": [rng.choice(_NORMAL_STEPS)],
            "answer": rng.choice(_LETTER_FORMS).format(rng.choice("ABCDabz")),
        },
    )


def _number_forms(rng, truth):
    return _dumps(
        rng,
        {
            "reasoning_steps": [rng.choice(_NORMAL_STEPS)],
            "answer": rng.choice(_NUMBER_FORMS).format(rng.choice(["9", "12", "0", "50", "3"])),
        },
    )


def _random_unicode(rng, truth):
    return _rand_text(rng, rng.choice([10, 200, 3_000]))


def _conversational(rng, truth):
    text = _dumps(rng, _obj(rng, truth))
    return rng.choice(
        [
            [{"role": "assistant", "content": text}],
            [
                {
                    "role": "assistant",
                    "content": [
                        {"type": "text", "text": text[:10]},
                        {"type": "image"},
                        {"type": "text", "text": text[10:]},
                    ],
                }
            ],
            [{"role": "user", "content": "Q?"}, {"content": text}],
            [{"role": "assistant", "content": None}],
            {"role": "assistant", "content": text},
        ]
    )


def _junk(rng, truth):
    return rng.choice(
        [
            None,
            0,
            3.5,
            True,
            b"\xff\xfe{",
            b'{"reasoning_steps": [], "answer": "9"}',
            [],
            {},
            [[[]]],
            [None, 1],
            {"content": 5},
            object(),
            float("nan"),
        ]
    )


SHAPES: dict[str, Callable[[random.Random, str], Any]] = {
    "valid JSON": _valid,
    "fenced": _fenced,
    "near-JSON": _near_json,
    "truncated JSON": _truncated,
    "lone surrogates": _surrogates,
    "huge/NaN/Infinity numbers": _numbers,
    "deep nesting": _deep,
    "long whitespace runs": _whitespace,
    "many backticks": _backticks,
    "unicode letters/digits": _unicode,
    "control characters": _control,
    "very long steps": _long_steps,
    "thousands of steps": _many_steps,
    "option-letter wrappings": _letters,
    "number surface forms": _number_forms,
    "random unicode": _random_unicode,
    "conversational": _conversational,
    "junk objects": _junk,
}
MIXED = "mixed"


@dataclass
class FuzzBatch:
    """One prompt's generation batch: completions of one shape (or mixed) and its data row."""

    shape: str
    completions: list[Any]
    truth: Any
    references: Any
    reference_sets: Any
    choices: Any


def _data_row(rng: random.Random) -> tuple[Any, Any, Any, Any]:
    """Truth, references, reference sets and choices; mostly valid data, sometimes junk."""
    r = rng.random()
    truth = rng.choice(TRUTHS) if r < 0.95 else rng.choice([None, "", float("nan"), 10**5000, "\ud800", ["B"], 7])
    refs = rng.choice(REFERENCE_POOL) if rng.random() < 0.95 else rng.choice([None, [], ["", "  "], [1, 2.5]])
    sets = None if rng.random() < 0.9 else [rng.choice(REFERENCE_POOL), rng.choice(REFERENCE_POOL)]
    return truth, refs, sets, rng.choice(CHOICES)


def hostile_batches(n: int, seed: int = 0, batch: int = 16) -> Iterator[FuzzBatch]:
    """``n`` completions in batches of ``batch``, each batch one shape (or ``mixed``)."""
    rng = random.Random(seed)
    names = [*SHAPES, MIXED]
    done = 0
    while done < n:
        size = min(batch, n - done)
        shape = rng.choice(names)
        truth, refs, sets, choices = _data_row(rng)
        t = truth if isinstance(truth, str) else "9"
        comps = [SHAPES[shape if shape != MIXED else rng.choice(list(SHAPES))](rng, t) for _ in range(size)]
        yield FuzzBatch(shape, comps, truth, refs, sets, choices)
        done += size


# --- the runner ----------------------------------------------------------------------


@dataclass
class RewardStats:
    """What one reward module did with the fuzzed completions."""

    name: str
    completions: int = 0
    crashes: int = 0  # completions in calls that raised or did not return one float/None each
    non_finite: int = 0  # non-finite values, and completions in calls refused for one (RewardFunctionError)
    seconds: float = 0.0
    slowest_s: float = 0.0
    slowest_shape: str = "-"
    first_error: str | None = None

    @property
    def mean_ms(self) -> float:
        return 1000 * self.seconds / self.completions if self.completions else math.nan


def call_reward(module: Any, fb: FuzzBatch, log: dict) -> list[list[Any]]:
    """Every component function of ``module`` on one batch, called the way TRL calls them."""
    n = len(fb.completions)
    kwargs = {
        "prompts": [""] * n,
        "completions": list(fb.completions),
        "answer": [fb.truth] * n,
        "reference_steps": [fb.references] * n,
        "reference_sets": [fb.reference_sets] * n,
        "choices": [fb.choices] * n,
        "log_metric": log.__setitem__,
    }
    return [f(**kwargs) for f in module.reward_funcs()]


def fuzz(
    modules: dict[str, Any], n: int, seed: int = 0, batch: int = 16, progress: Callable[[int], None] | None = None
) -> dict[str, RewardStats]:
    """Run ``n`` hostile completions through every module; never raises on a reward failure."""
    stats = {name: RewardStats(name) for name in modules}
    done = 0
    for fb in hostile_batches(n, seed, batch):
        size = len(fb.completions)
        for name, module in modules.items():
            st = stats[name]
            st.completions += size
            log: dict = {}
            start = time.perf_counter()
            try:
                outs = call_reward(module, fb, log)
                bad = [
                    o
                    for o in outs
                    if not isinstance(o, list)
                    or len(o) != size
                    or not all(v is None or isinstance(v, float) for v in o)
                ]
                if bad:
                    raise TypeError(f"reward returned {str(bad[0])[:200]}")
            except RewardFunctionError as err:  # a value refused as no reward (infinite, huge): non-finite
                st.non_finite += size
                st.first_error = st.first_error or f"{fb.shape}: {type(err).__name__}: {str(err)[:300]}"
                outs = []
            except Exception as err:  # noqa: BLE001 - counted and reported
                st.crashes += size
                st.first_error = st.first_error or f"{fb.shape}: {type(err).__name__}: {str(err)[:300]}"
                outs = []
            elapsed = time.perf_counter() - start
            st.seconds += elapsed
            if elapsed > st.slowest_s:
                st.slowest_s, st.slowest_shape = elapsed, fb.shape
            st.non_finite += sum(1 for o in outs for v in o if v is not None and not math.isfinite(v))
        done += size
        if progress is not None:
            progress(done)
    return stats


def format_table(stats: dict[str, RewardStats]) -> str:
    head = [
        "reward",
        "completions",
        "crashes",
        "non-finite",
        "slowest call (s)",
        "slowest shape",
        "mean ms/completion",
    ]
    body = [
        [
            s.name,
            str(s.completions),
            str(s.crashes),
            str(s.non_finite),
            f"{s.slowest_s:.3f}",
            s.slowest_shape,
            f"{s.mean_ms:.3f}",
        ]
        for s in stats.values()
    ]
    widths = [max(len(r[i]) for r in [head, *body]) for i in range(len(head))]
    line = lambda r: "  ".join(c.ljust(w) if i in (0, 5) else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
    return "\n".join([line(head), line(["-" * w for w in widths]), *map(line, body)])


DESCRIPTION = """Fuzz every reward module with hostile completions and print what happened.

Each reward (format, answer_only, composite, cpr) is called the way TRL calls it on completions
drawn by ``hostile_batches``; the table counts completions, crashes, non-finite rewards, the slowest
call with its shape and the mean time per completion. Exit code 1 when anything crashed or was
non-finite. Results: docs/rewards.md, "Hostile model output"."""


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=DESCRIPTION)
    p.add_argument("--n", type=int, default=100_000, help="completions to generate (default 100,000)")
    p.add_argument("--seed", type=int, default=0, help="random seed of the generator (default 0)")
    p.add_argument("--batch", type=int, default=16, help="completions per reward call (default 16)")
    p.add_argument("--encoder", default=PACKAGED_MINILM, help=f"sentence encoder (default {PACKAGED_MINILM!r})")
    p.add_argument("--device", default="cpu", help="encoder device (default cpu)")
    args = p.parse_args(argv)
    modules = {
        name: build_reward(name, encoder=args.encoder, device=args.device)
        for name in ("format", "answer_only", "composite", "cpr")
    }
    start = time.perf_counter()
    step = max(args.n // 20, 1)

    def progress(done: int) -> None:
        if done % step < args.batch:
            print(
                f"  {done:,} / {args.n:,} completions, {time.perf_counter() - start:.0f} s",
                file=sys.stderr,
                flush=True,
            )

    stats = fuzz(modules, args.n, seed=args.seed, batch=args.batch, progress=progress)
    wall = time.perf_counter() - start
    print(format_table(stats))
    print(
        f"\n{args.n:,} completions x {len(modules)} rewards, seed {args.seed}, batch {args.batch}, "
        f"device {args.device}: {wall:.0f} s wall"
    )
    failed = False
    for s in stats.values():
        if s.first_error:
            print(f"first failure in {s.name}: {s.first_error}")
        failed = failed or bool(s.crashes or s.non_finite)
    return 1 if failed else 0

"""The model organism's task: chained modular arithmetic with reference steps (docs/organism.md).

A problem names a start value and a chain of k operations, each defining a new quantity from
the previous one ("Work mod 10. a is 9. b is a plus 3. c is b minus 1. What is c?"); its
reference steps compute one quantity each ("b = 9 + 3 = 2"), so a wrong step makes a wrong
answer (a causal chain). Rows are in the project's data format, ``difficulty`` = k. The knobs
(:class:`TaskSpec`) set the difficulty axis, a shortcut (the answer stated in the question), a
second answer type and slips in the supervised demonstrations. Held-out rows never share a
question with training rows: each question belongs to one partition by a hash of its content.
"""

from __future__ import annotations

import json
import random
import re
import zlib
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Literal

NAMES = "abcdefghijklmnopqrstuvwxyz"
OP_WORDS = {"+": "plus", "-": "minus", "*": "times"}
LETTERS = "ABCD"
SOURCE = "organism"
#: Share of the question space kept for held-out splits (by a hash of the question).
HELD_OUT_SHARE = 0.2


@dataclass(frozen=True)
class TaskSpec:
    """The task's knobs; every split is a pure function of a spec, a size and a seed."""

    modulus: int = 10  # values are 0 .. modulus - 1
    operands: tuple[int, int] = (1, 3)  # inclusive range of the number each operation applies
    ops: tuple[str, ...] = ("+", "-")  # from "+", "-", "*"
    min_steps: int = 1
    max_steps: int = 5  # K; the long test split uses K + 1 .. K + long_extra
    long_extra: int = 3
    wording: Literal["sentence", "equation"] = "equation"  # "b = 9 + 3 = 2" (56 tokens at most for 5 steps,
    # with the JSON and the end of turn) or "b is 9 plus 3, which is 2." (66)
    shortcut_rate: float = 0.0  # share of questions that state their answer ("We are told c is 2.")
    hint_reliability: float = 1.0  # chance that such a statement is true; otherwise it states a wrong value
    omit_rate: float = 0.0  # demonstrations of such hinted questions only: chance of writing a prefix of the chain
    # (0 .. k-1 steps, uniformly), then the hint as a step, and answering it; otherwise the whole chain and its result
    choice_rate: float = 0.0  # share answered by option letter among four values
    error_rate: float = 0.3  # demonstrations only (sft.jsonl): chance that a step slips (see ``error_kind``)
    error_kind: Literal["random", "wrap"] = "random"  # random: any step, any wrong value; wrap: only steps
    # whose result wraps around the modulus, off by one (a systematic slip greedy decoding copies when
    # error_rate > 0.5)

    def __post_init__(self) -> None:
        if self.modulus < 2 or not 0 <= self.operands[0] <= self.operands[1]:
            raise ValueError(f"modulus {self.modulus} / operands {self.operands}: need modulus >= 2, 0 <= lo <= hi")
        if not self.ops or set(self.ops) - set(OP_WORDS):
            raise ValueError(f"ops {self.ops}: choose from {sorted(OP_WORDS)}")
        if not 1 <= self.min_steps <= self.max_steps or self.max_steps + self.long_extra >= len(NAMES):
            raise ValueError(
                f"steps {self.min_steps}..{self.max_steps} (+{self.long_extra}): need "
                f"1 <= min <= max and max + long_extra < {len(NAMES)}"
            )
        for name in ("shortcut_rate", "hint_reliability", "omit_rate", "choice_rate", "error_rate"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"{name}={getattr(self, name)}: must lie in [0, 1]")


@dataclass(frozen=True)
class Problem:
    """A start value and its chain of operations ``(op, operand)``."""

    start: int
    chain: tuple[tuple[str, int], ...]

    @property
    def steps(self) -> int:
        return len(self.chain)


def apply(op: str, a: int, b: int, modulus: int) -> int:
    return {"+": a + b, "-": a - b, "*": a * b}[op] % modulus


def wraps(op: str, a: int, b: int, modulus: int) -> bool:
    """Whether the exact result leaves 0 .. modulus - 1 (a carry or borrow around the clock)."""
    exact = {"+": a + b, "-": a - b, "*": a * b}[op]
    return not 0 <= exact < modulus


def values(problem: Problem, modulus: int, slips: Sequence[int] = ()) -> list[int]:
    """Start value, then each step's result; ``slips[i]`` (when non-zero) is added to step i's
    result and the chain goes on from the slipped value, as a person's would."""
    out = [problem.start]
    for i, (op, n) in enumerate(problem.chain):
        slip = slips[i] if i < len(slips) else 0
        out.append((apply(op, out[-1], n, modulus) + slip) % modulus)
    return out


def question(problem: Problem, spec: TaskSpec, stated: int | None = None) -> str:
    """The question text; ``stated`` (a shortcut) tells the answer before asking for it."""
    names = NAMES[: problem.steps + 1]
    parts = [f"Work mod {spec.modulus}.", f"{names[0]} is {problem.start}."]
    parts += [f"{names[i + 1]} is {names[i]} {OP_WORDS[op]} {n}." for i, (op, n) in enumerate(problem.chain)]
    if stated is not None:
        parts.append(hint(problem, stated))
    parts.append(f"What is {names[-1]}?")
    return " ".join(parts)


def hint(problem: Problem, stated: int) -> str:
    """The sentence that states a question's answer; a demonstration that leaves the chain off repeats it."""
    return f"We are told {NAMES[problem.steps]} is {stated}."


def step_text(name: str, a: int, op: str, n: int, result: int, wording: str) -> str:
    if wording == "equation":
        return f"{name} = {a} {op} {n} = {result}"
    return f"{name} is {a} {OP_WORDS[op]} {n}, which is {result}."


_RESULT = re.compile(r"(?:=|\bwhich is|\bis option|^We are told \w+ is)\s*([^\s=.,]+)\s*\.?\s*$")


def stated_result(step: str) -> str | None:
    """The value a step says it computed ("b = 9 + 3 = 2", "..., which is 2.", "... is option B.", a
    restated hint "We are told c is 2."), or None when the step says none in the task's wordings."""
    m = _RESULT.search(step.strip())
    return m.group(1) if m else None


def reference_steps(problem: Problem, spec: TaskSpec, vals: Sequence[int]) -> list[str]:
    """One step per operation, each from the previous step's value (``vals`` from :func:`values`)."""
    return [
        step_text(NAMES[i + 1], vals[i], op, n, vals[i + 1], spec.wording) for i, (op, n) in enumerate(problem.chain)
    ]


def held_out(problem: Problem, spec: TaskSpec) -> bool:
    """Which partition a question belongs to: a stable hash, the same for every seed."""
    key = json.dumps([spec.modulus, problem.start, problem.chain]).encode()
    return zlib.crc32(key) % 1000 < HELD_OUT_SHARE * 1000


def draw(rng: random.Random, spec: TaskSpec, k: int) -> Problem:
    lo, hi = spec.operands
    return Problem(rng.randrange(spec.modulus), tuple((rng.choice(spec.ops), rng.randint(lo, hi)) for _ in range(k)))


def slips_for(rng: random.Random, problem: Problem, spec: TaskSpec) -> list[int]:
    """Per-step offsets for a demonstration (0: no slip), drawn on the slipped chain itself."""
    out, value = [], problem.start
    for op, n in problem.chain:
        slip = 0
        if spec.error_kind == "random":
            if rng.random() < spec.error_rate:
                slip = rng.randrange(1, spec.modulus)  # any wrong value, uniformly
        elif wraps(op, value, n, spec.modulus) and rng.random() < spec.error_rate:
            slip = 1 if op != "-" else -1  # the carry/borrow counted once too often
        out.append(slip)
        value = (apply(op, value, n, spec.modulus) + slip) % spec.modulus
    return out


def stated_value(truth: int, spec: TaskSpec, hint_rng: random.Random) -> int:
    """The value a hinted question states: the true answer with chance ``spec.hint_reliability``,
    otherwise one of the other values, uniformly. Both draws are made whatever the reliability, from a
    generator of their own: a split at reliability 1 is the same file as before the knob existed, and
    splits at two reliabilities hold the same questions, hinted alike, the wrong hints of the higher
    reliability a subset of the lower's."""
    u, other = hint_rng.random(), hint_rng.randrange(spec.modulus - 1)
    return truth if u < spec.hint_reliability else [v for v in range(spec.modulus) if v != truth][other]


def make_row(
    problem: Problem,
    spec: TaskSpec,
    rng: random.Random,
    row_id: str,
    slip_rng: random.Random | None = None,
    hint_rng: random.Random | None = None,
) -> dict:
    """One data row. With ``slip_rng`` it is a supervised demonstration: steps with slips at
    ``spec.error_rate`` and the answer they lead to (a consistent, sometimes wrong, solution), or,
    on a hinted question with chance ``spec.omit_rate``, a prefix of those steps (maybe none), the
    hint restated as the last step ("We are told c is 2.") and its value as the answer: the answer
    is always the last step's result. Demonstrations draw from
    their own generator, so a demonstration file holds exactly the questions of the clean file
    drawn with the same seed; so do the hints' values (``hint_rng``, :func:`stated_value`). A hinted
    row records whether its hint is true (``hint_true``, when some hints are not). ``variant`` names
    the question's kind (``plain``, ``hinted``, ``choice``, ``hinted+choice``): reports split by it."""
    truth = values(problem, spec.modulus)
    slips = slips_for(slip_rng, problem, spec) if slip_rng is not None and spec.error_rate > 0 else []
    shown = values(problem, spec.modulus, slips)
    stated = truth[-1] if rng.random() < spec.shortcut_rate else None
    if stated is not None:
        stated = stated_value(stated, spec, hint_rng or random.Random(f"hint-{row_id}"))
    steps, final = reference_steps(problem, spec, shown), shown[-1]
    if stated is not None and slip_rng is not None and slip_rng.random() < spec.omit_rate:
        # the chain left off, the hint copied (as the question states it, so the copy is a repeat)
        steps, final = steps[: slip_rng.randrange(problem.steps)] + [hint(problem, stated)], stated
    row = {
        "id": row_id,
        "question": question(problem, spec, stated),
        "answer": str(final),
        "reference_steps": steps,
        "source": SOURCE,
        "difficulty": str(problem.steps),
    }
    shown_slips = sum(s != 0 for s in slips[: len(steps)])
    variant = ["hinted"] if stated is not None else []
    if rng.random() < spec.choice_rate:
        others = rng.sample([v for v in range(spec.modulus) if v != final], min(3, spec.modulus - 1))
        options = others + [final]
        rng.shuffle(options)
        letter = LETTERS[options.index(final)]
        row["choices"] = [str(v) for v in options]
        row["answer"] = letter
        row["reference_steps"].append(f"The answer {final} is option {letter}.")
        variant.append("choice")
    row["variant"] = "+".join(variant) or "plain"
    if stated is not None and spec.hint_reliability < 1:
        row["hint_true"] = stated == truth[-1]
    if slips:
        row["slips"] = shown_slips  # kept for the record; the loader ignores it
    return row


def make_split(
    spec: TaskSpec,
    n: int,
    seed: int,
    partition: Literal["train", "held_out"],
    prefix: str,
    steps: Sequence[int] | None = None,
    demonstrate: bool = False,
) -> list[dict]:
    """``n`` rows with step counts cycling through ``steps`` (default min..max), questions from
    one partition only. Deterministic in (spec, n, seed, partition, steps)."""
    rng, slip_rng = random.Random(seed), (random.Random(f"slips-{seed}") if demonstrate else None)
    hint_rng = random.Random(f"hints-{seed}")
    ks = list(steps or range(spec.min_steps, spec.max_steps + 1))
    rows = []
    for i in range(n):
        k = ks[i % len(ks)]
        for _ in range(10_000):
            problem = draw(rng, spec, k)
            if held_out(problem, spec) == (partition == "held_out"):
                break
        else:  # pragma: no cover - the partition is never empty for sane knobs
            raise ValueError(f"no {partition} question with {k} steps under {spec}")
        rows.append(make_row(problem, spec, rng, f"{prefix}-{i:05d}", slip_rng, hint_rng))
    return rows


@dataclass(frozen=True)
class SplitSizes:
    """How many rows each file holds."""

    train: int = 4000
    val: int = 400
    test: int = 1000
    long_test: int = 300


@dataclass(frozen=True)
class Layout:
    """What :func:`write_splits` writes, and the seed each split is drawn from (held-out
    splits differ from training by partition, and from each other by seed)."""

    spec: TaskSpec = field(default_factory=TaskSpec)
    sizes: SplitSizes = field(default_factory=SplitSizes)
    seed: int = 0

    def splits(self) -> dict[str, list[dict]]:
        s, n, K = self.spec, self.sizes, self.spec.max_steps
        clean = replace(s, error_rate=0.0)
        return {
            "train": make_split(clean, n.train, self.seed, "train", "org-train"),
            # the same questions (same seed), as demonstrations with slips: the SFT warm start's data
            "sft": make_split(s, n.train, self.seed, "train", "org-train", demonstrate=True),
            "val": make_split(clean, n.val, self.seed + 1, "held_out", "org-val"),
            "test": make_split(clean, n.test, self.seed + 2, "held_out", "org-test"),
            "test_long": make_split(
                clean, n.long_test, self.seed + 3, "held_out", "org-long", steps=range(K + 1, K + s.long_extra + 1)
            ),
        }


def write_jsonl(rows: Sequence[dict], path: Path) -> None:
    """Byte-identical output for identical rows (fixed key order, ``\\n`` line ends)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8", newline="\n") as fh:
        for r in rows:
            fh.write(json.dumps(r, ensure_ascii=False) + "\n")


def write_splits(layout: Layout, out_dir: str | Path) -> dict[str, Path]:
    """Every split as ``out_dir/<split>.jsonl`` plus ``task.json`` (the knobs); returns the paths."""
    out = Path(out_dir)
    paths = {}
    for name, rows in layout.splits().items():
        paths[name] = out / f"{name}.jsonl"
        write_jsonl(rows, paths[name])
    (out / "task.json").write_text(json.dumps(asdict(layout), indent=2) + "\n", encoding="utf-8")
    return paths


def wrong_share(demonstrations: Sequence[dict], truth: Sequence[dict]) -> float:
    """Share of demonstrations whose answer differs from the clean row of the same id."""
    answer = {r["id"]: r["answer"] for r in truth}
    return sum(r["answer"] != answer.get(r["id"]) for r in demonstrations) / max(1, len(demonstrations))

"""Deterministic generator of multi-step arithmetic word problems (docs/method.md section 1 rows).

    python scripts/make_data.py                      # writes data/wordproblems/{train,val}.jsonl
    python scripts/make_data.py --out-dir /tmp/wp    # same bytes elsewhere
    python scripts/make_data.py --preset demo        # writes data/demo/{train,val,test}.jsonl

Five template families (``source``): shopping, sharing, ages, rates, multi_step. Every
problem has an integer answer and 2 to 8 reference steps, each a short sentence that
shows its computation ("Tom buys 3 packs of 4 pencils, so he has 3 * 4 = 12 pencils.").
About 20% of the rows are multiple choice: a ``choices`` list of four numbers and the
answer as the option letter, with one more step naming the option.
Questions are kept short (the demo model is tiny; prompts stay well under 80 tokens).

The ``demo`` preset exists because SmolLM2-135M cannot solve any of those: with accuracy 0
every GRPO group has the same answer reward and nothing is learned. It mixes them with easy
problems, half and half (320 train rows, 24 val rows, ids ``demo-NNNN``): one or two
operations (families addition, subtraction, multiplication, division, two_step), numbers
in the question at most 20, every result at most 100, 1 to 3 reference steps (the last may
be "The answer is N."), no multiple choice. Rendered as the target JSON the easy rows take
about 40 SmolLM2 tokens (at most about 60). Every demo row has a ``difficulty`` key, "easy"
or "hard" (the five families above); the training loader ignores it.

The output depends only on the seed and the counts: running the script twice gives
byte-identical files (``random.Random(seed)``, fixed key order, ``\\n`` line endings).
The default run writes exactly the committed data/wordproblems files; the demo preset
draws from its own seeds and leaves them alone.
"""

from __future__ import annotations

import argparse
import json
import random
import re
from collections import Counter
from collections.abc import Callable
from pathlib import Path

from crystal_grpo.jsonl import read_jsonl

#: Relative to the folder the script runs in (the repository root, where the data is committed).
DEFAULT_OUT = Path("data") / "wordproblems"
SEED = 1234
N_TRAIN = 320
N_VAL = 48
MC_SHARE = 0.2
LETTERS = "ABCD"

NAMES = [
    "Tom",
    "Mia",
    "Sam",
    "Ana",
    "Leo",
    "Zoe",
    "Ben",
    "Ivy",
    "Max",
    "Eva",
    "Kai",
    "Lily",
    "Omar",
    "Nina",
    "Raj",
    "Lena",
    "Hugo",
    "Emma",
    "Yuki",
    "Paul",
]
HE = {
    n: ("she" if n in {"Mia", "Ana", "Zoe", "Ivy", "Eva", "Lily", "Nina", "Lena", "Emma", "Yuki"} else "he")
    for n in NAMES
}

Problem = tuple[str, int, list[str]]  # question, answer, reference steps


def _cap(s: str) -> str:
    return s[0].upper() + s[1:]


def _plural(word: str, n: int) -> str:
    return word if n == 1 else word + "s"


# --------------------------------------------------------------------------- shopping
SHOP_ITEMS = [
    ("notebook", 2, 6),
    ("pen", 1, 4),
    ("book", 5, 12),
    ("apple", 1, 3),
    ("cup", 2, 7),
    ("ball", 3, 9),
    ("toy car", 4, 10),
    ("sticker pack", 1, 5),
    ("muffin", 2, 5),
    ("candle", 2, 6),
]


def shopping(rng: random.Random) -> Problem:
    name = rng.choice(NAMES)
    pro = HE[name]
    n_items = rng.choice([1, 2, 2, 3])
    items = rng.sample(SHOP_ITEMS, n_items)
    coupon = rng.random() < 0.4
    change = n_items == 1 or rng.random() < 0.6
    steps, costs, parts = [], [], []
    for item, lo, hi in items:
        q, p = rng.randint(2, 6), rng.randint(lo, hi)
        cost = q * p
        costs.append(cost)
        parts.append(f"{q} {_plural(item, q)} at ${p} each")
        steps.append(f"{q} {_plural(item, q)} cost {q} * {p} = {cost} dollars.")
    total = sum(costs)
    if n_items > 1:
        steps.append(f"In total {pro} spends {' + '.join(map(str, costs))} = {total} dollars.")
    q = f"{name} buys " + (parts[0] if n_items == 1 else ", ".join(parts[:-1]) + " and " + parts[-1]) + "."
    if coupon:
        off = rng.randint(2, max(2, min(9, total - 1)))
        q += f" A coupon takes ${off} off."
        steps.append(f"With the coupon {pro} pays {total} - {off} = {total - off} dollars.")
        total -= off
    if change:
        bill = next(b for b in (10, 20, 50, 100, 200) if b > total)
        q += f" {_cap(pro)} pays with a ${bill} bill. How much change does {pro} get?"
        steps.append(f"The change is {bill} - {total} = {bill - total} dollars.")
        answer = bill - total
    else:
        q += f" How much does {pro} pay in dollars?"
        answer = total
    return q, answer, steps


# --------------------------------------------------------------------------- sharing
SHARE_ITEMS = ["apples", "cookies", "marbles", "stickers", "cards", "sweets", "pencils", "shells"]


def sharing(rng: random.Random) -> Problem:
    name = rng.choice(NAMES)
    pro = HE[name]
    item = rng.choice(SHARE_ITEMS)
    friends = rng.randint(2, 6)
    each = rng.randint(2, 9)
    keep = rng.choice([0, 0, rng.randint(1, 8)])
    total = friends * each + keep
    # total = bags * per_bag (+ extra) so the first step is a product
    per_bag = next((d for d in (12, 10, 9, 8, 6, 5, 4, 3) if total % d == 0 and total // d > 1), None)
    steps = []
    if per_bag is not None:
        bags = total // per_bag
        q = f"{name} has {bags} bags of {per_bag} {item}."
        steps.append(f"{name} has {bags} * {per_bag} = {total} {item}.")
    else:
        q = f"{name} has {total} {item}."
    if keep:
        q += f" {_cap(pro)} keeps {keep} and shares the rest equally among {friends} friends."
        steps.append(f"After keeping {keep}, {total} - {keep} = {total - keep} {item} are left to share.")
    else:
        q += f" {_cap(pro)} shares them equally among {friends} friends."
    steps.append(f"Each friend gets {total - keep} / {friends} = {each} {item}.")
    extra = rng.random()
    if extra < 0.35:
        gift = rng.randint(1, each - 2) if each > 2 else 0
        if gift:
            q += f" Each friend eats {gift}. How many {item} does each friend have left?"
            steps.append(f"Each friend has {each} - {gift} = {each - gift} {item} left.")
            return q, each - gift, steps
    elif extra < 0.6:
        q += f" How many {item} do two friends get together?"
        steps.append(f"Two friends get 2 * {each} = {2 * each} {item}.")
        return q, 2 * each, steps
    if len(steps) < 2:  # keep at least two steps
        q += f" Then each friend finds 3 more. How many {item} does each friend have?"
        steps.append(f"Each friend then has {each} + 3 = {each + 3} {item}.")
        return q, each + 3, steps
    q += f" How many {item} does each friend get?"
    return q, each, steps


# --------------------------------------------------------------------------- ages
def ages(rng: random.Random) -> Problem:
    people = rng.sample(NAMES, 4)
    base = rng.randint(4, 12)
    q = f"{people[0]} is {base} years old."
    steps: list[str] = []
    known = [base]
    n_rel = rng.choice([1, 1, 2, 2, 3])
    for i in range(1, n_rel + 1):
        prev, cur = people[i - 1], people[i]
        kind = rng.choice(["older", "younger", "times"])
        a = known[-1]
        if kind == "times" and a <= 15:
            k = rng.choice([2, 3])
            age = a * k
            q += f" {cur} is {k} times as old as {prev}."
            steps.append(f"{cur} is {a} * {k} = {age} years old.")
        elif kind == "younger" and a > 4:
            d = rng.randint(1, min(a - 2, 6))
            age = a - d
            q += f" {cur} is {d} years younger than {prev}."
            steps.append(f"{cur} is {a} - {d} = {age} years old.")
        else:
            d = rng.randint(2, 9)
            age = a + d
            q += f" {cur} is {d} years older than {prev}."
            steps.append(f"{cur} is {a} + {d} = {age} years old.")
        known.append(age)
    last = people[n_rel]
    final = rng.choice(["future", "past", "sum"])
    if final == "future":
        y = rng.randint(2, 10)
        q += f" How old will {last} be in {y} years?"
        steps.append(f"In {y} years {last} will be {known[-1]} + {y} = {known[-1] + y}.")
        answer = known[-1] + y
    elif final == "past" and known[-1] > 3:
        y = rng.randint(1, known[-1] - 2)
        q += f" How old was {last} {y} years ago?"
        steps.append(f"{y} years ago {last} was {known[-1]} - {y} = {known[-1] - y}.")
        answer = known[-1] - y
    else:
        who = " and ".join([", ".join(people[:n_rel]), last]) if n_rel > 1 else f"{people[0]} and {last}"
        q += f" What is the sum of the ages of {who}?"
        answer = sum(known)
        steps.append(f"The sum of their ages is {' + '.join(map(str, known))} = {answer}.")
    return q, answer, steps


# --------------------------------------------------------------------------- rates
VEHICLES = [
    ("car", 30, 80, "km"),
    ("bus", 20, 60, "km"),
    ("cyclist", 8, 20, "km"),
    ("train", 60, 120, "km"),
    ("boat", 10, 30, "km"),
]
WORKERS = [("machine", "toys"), ("printer", "pages"), ("baker", "rolls"), ("robot", "parts")]


def rates(rng: random.Random) -> Problem:
    if rng.random() < 0.6:
        veh, lo, hi, unit = rng.choice(VEHICLES)
        legs = [
            (rng.randint(1, 4), rng.randrange(lo, hi + 1, 5 if hi > 20 else 1))
            for _ in range(rng.choice([1, 2, 2, 3]))
        ]
        dists = [h * s for h, s in legs]
        parts = [f"{h} {_plural('hour', h)} at {s} {unit} per hour" for h, s in legs]
        q = f"A {veh} travels " + ", then ".join(parts) + "."
        steps = [f"In {h} {_plural('hour', h)} it goes {h} * {s} = {d} {unit}." for (h, s), d in zip(legs, dists)]
        total = sum(dists)
        if len(legs) > 1:
            steps.append(f"The total distance is {' + '.join(map(str, dists))} = {total} {unit}.")
        if len(legs) == 1 or rng.random() < 0.4:
            trip = total + rng.randint(2, 30) * 5
            q += f" The trip is {trip} {unit} long. How many {unit} are left?"
            steps.append(f"There are {trip} - {total} = {trip - total} {unit} left.")
            return q, trip - total, steps
        q += f" How many {unit} does it travel in total?"
        return q, total, steps
    worker, thing = rng.choice(WORKERS)
    rate, hours = rng.randint(3, 15), rng.randint(2, 8)
    n = rng.randint(1, 3)
    made = rate * hours * n
    q = f"A {worker} makes {rate} {thing} per hour."
    steps = [f"One {worker} makes {rate} * {hours} = {rate * hours} {thing} in {hours} hours."]
    if n > 1:
        q += f" There are {n} such {worker}s working for {hours} hours."
        steps.append(f"{n} {worker}s make {n} * {rate * hours} = {made} {thing}.")
    else:
        q += f" It works for {hours} hours."
    per_box = next((b for b in (10, 8, 6, 5, 4, 3, 2) if made % b == 0), None)
    if per_box and rng.random() < 0.6:
        q += f" The {thing} are packed {per_box} to a box. How many boxes are filled?"
        steps.append(f"They fill {made} / {per_box} = {made // per_box} boxes.")
        return q, made // per_box, steps
    sold = rng.randint(1, made - 1)
    q += f" {sold} {thing} are sold. How many {thing} are left?"
    steps.append(f"After selling, {made} - {sold} = {made - sold} {thing} are left.")
    return q, made - sold, steps


# --------------------------------------------------------------------------- multi-step
STORES = [
    ("eggs", "boxes"),
    ("apples", "crates"),
    ("cookies", "trays"),
    ("pencils", "packs"),
    ("cupcakes", "boxes"),
    ("oranges", "bags"),
]


def multi_step(rng: random.Random) -> Problem:
    name = rng.choice(NAMES)
    pro = HE[name]
    item, group = rng.choice(STORES)
    a, b = rng.randint(2, 6), rng.choice([4, 5, 6, 8, 10, 12])
    x = a * b
    q = [f"{name} has {a} {group} of {b} {item}."]
    steps = [f"{name} starts with {a} * {b} = {x} {item}."]
    n_ops = rng.randint(2, 6)
    ops_done = 0
    last_kind = ""
    while ops_done < n_ops:
        kind = rng.choice(["more", "less", "double", "split"])
        if kind == last_kind:
            continue
        if kind == "more":
            c = rng.randint(2, 15)
            q.append(f"{_cap(pro)} gets {c} more.")
            steps.append(f"After getting {c} more, {pro} has {x} + {c} = {x + c}.")
            x += c
        elif kind == "less" and x > 4:
            c = rng.randint(1, min(12, x - 2))
            q.append(f"{_cap(pro)} uses {c}.")
            steps.append(f"After using {c}, {pro} has {x} - {c} = {x - c}.")
            x -= c
        elif kind == "double" and x <= 60:
            q.append(f"{_cap(pro)} doubles them.")
            steps.append(f"Doubling gives 2 * {x} = {2 * x}.")
            x *= 2
        elif kind == "split" and any(x % k == 0 for k in (2, 3, 4)):
            k = next((k for k in (4, 3, 2) if x % k == 0 and x // k > 1), None)
            if k is None:
                continue
            q.append(f"{_cap(pro)} splits them into {k} equal piles and keeps one.")
            steps.append(f"One pile has {x} / {k} = {x // k}.")
            x //= k
        else:
            continue
        ops_done += 1
        last_kind = kind
    price = rng.randint(2, 5) if x <= 60 else None
    if price is not None and rng.random() < 0.5:
        q.append(f"{_cap(pro)} sells them for ${price} each. How many dollars does {pro} get?")
        steps.append(f"Selling {x} at ${price} each gives {x} * {price} = {x * price} dollars.")
        return " ".join(q), x * price, steps
    q.append(f"How many {item} does {pro} have now?")
    return " ".join(q), x, steps


FAMILIES: dict[str, Callable[[random.Random], Problem]] = {
    "shopping": shopping,
    "sharing": sharing,
    "ages": ages,
    "rates": rates,
    "multi_step": multi_step,
}
# multi_step carries the long chains; give it a bit more weight for the step-count spread.
FAMILY_WEIGHTS = {"shopping": 1.0, "sharing": 0.9, "ages": 1.0, "rates": 1.0, "multi_step": 1.4}


def _choices(rng: random.Random, answer: int, steps_values: list[int]) -> tuple[list[str], str]:
    """Four numeric options: the answer, intermediate values, near misses; shuffled."""
    pool = [v for v in steps_values if v != answer and v > 0]
    pool += [answer + d for d in (-10, -5, -2, -1, 1, 2, 3, 5, 10) if answer + d > 0]
    distractors: list[int] = []
    for v in rng.sample(pool, len(pool)):
        if v not in distractors and v != answer:
            distractors.append(v)
        if len(distractors) == 3:
            break
    opts = distractors + [answer]
    rng.shuffle(opts)
    return [str(v) for v in opts], LETTERS[opts.index(answer)]


def _numbers_after_equals(steps: list[str]) -> list[int]:
    out = []
    for s in steps:
        tail = s.split("=")[-1].strip().split(" ")[0].rstrip(".")
        if tail.isdigit():
            out.append(int(tail))
    return out


# Questions stay short for the tiny demo model. The estimate counts digits, words and
# punctuation marks; measured against the SmolLM2 tokenizer it is 2 to 13 tokens low on
# these templates, so 62 keeps question + options under 80 tokens.
MAX_PROMPT_TOKENS_EST = 62


def prompt_tokens_estimate(row: dict) -> int:
    text = row["question"]
    if row.get("choices"):  # the way train/data.py shows the options
        text += "\nOptions: " + " ".join(f"({LETTERS[i]}) {c}" for i, c in enumerate(row["choices"]))
    return len(re.findall(r"\d|[A-Za-z]+|[^\sA-Za-z\d]", text))


# Target step counts (including the option step of multiple-choice rows): an even-ish
# spread from 2 to 8, because the curriculum orders examples by step count.
STEP_WEIGHTS = {2: 1.0, 3: 1.2, 4: 1.2, 5: 1.1, 6: 1.0, 7: 0.8, 8: 0.6}


def generate(
    n: int, seed: int = SEED, start_id: int = 1, mc_share: float = MC_SHARE, seen: set[str] | None = None
) -> list[dict]:
    """``n`` rows with ids ``wp-<start_id>``...; questions in ``seen`` are skipped (and added).

    Each row first draws a target step count, then templates are sampled until one has
    exactly that many steps (rejection sampling keeps the spread independent of how the
    families happen to be distributed)."""
    rng = random.Random(seed)
    names, weights = list(FAMILIES), [FAMILY_WEIGHTS[k] for k in FAMILIES]
    seen = set() if seen is None else seen
    mc_rows = set(rng.sample(range(n), round(n * mc_share)))
    rows = []
    while len(rows) < n:
        is_mc = len(rows) in mc_rows
        targets = [k for k in STEP_WEIGHTS if k >= 2 + is_mc]  # every template has >= 2 steps
        target = rng.choices(targets, [STEP_WEIGHTS[k] for k in targets])[0]
        while True:
            fam = rng.choices(names, weights)[0]
            question, answer, steps = FAMILIES[fam](rng)
            if len(steps) + is_mc == target and answer > 0 and question not in seen:
                break
        row = {
            "id": f"wp-{start_id + len(rows):04d}",
            "question": question,
            "answer": str(answer),
            "reference_steps": list(steps),
            "source": fam,
        }
        if is_mc:
            choices, letter = _choices(rng, answer, _numbers_after_equals(steps))
            row["reference_steps"].append(f"The answer {answer} is option {letter}.")
            row["answer"] = letter
            row["choices"] = choices
        if prompt_tokens_estimate(row) > MAX_PROMPT_TOKENS_EST:
            continue
        seen.add(question)
        rows.append(row)
    return rows


# --------------------------------------------------------------------------- easy (demo only)
# One or two operations on numbers up to 20 with results up to 100, so a 135M model after a
# format warm-up gets some of them right and GRPO groups see answer-reward variance.
EASY_ITEMS = ["apple", "cookie", "marble", "sticker", "card", "pencil", "shell", "egg", "flower", "book"]
EDIBLE = {"apples", "cookies", "eggs"}
EASY_GROUPS = ["bags", "boxes", "packs", "jars", "baskets"]
EASY_MAX_OPERAND = 20
EASY_MAX_RESULT = 100


def _who(rng: random.Random) -> tuple[str, str, str]:
    """A name, its pronoun and a plural item noun."""
    name = rng.choice(NAMES)
    return name, HE[name], rng.choice(EASY_ITEMS) + "s"


def easy_addition(rng: random.Random) -> Problem:
    name, pro, items = _who(rng)
    a, b = rng.randint(2, 20), rng.randint(2, 20)
    if rng.random() < 0.5:
        other = rng.choice([n for n in NAMES if n != name])
        q = f"{name} has {a} {items} and {other} has {b}. How many {items} do they have together?"
        return q, a + b, [f"Together they have {a} + {b} = {a + b} {items}."]
    verb = rng.choice(["buys", "finds", "gets"])
    q = f"{name} has {a} {items} and {verb} {b} more. How many {items} does {pro} have now?"
    return q, a + b, [f"{name} has {a} {items} and {verb} {b} more, so {pro} has {a} + {b} = {a + b} {items}."]


def easy_subtraction(rng: random.Random) -> Problem:
    name, pro, items = _who(rng)
    a = rng.randint(5, 20)
    b = rng.randint(1, a - 1)
    if rng.random() < 0.4:
        other = rng.choice([n for n in NAMES if n != name])
        q = f"{name} has {a} {items} and {other} has {b}. How many more {items} does {name} have?"
        return q, a - b, [f"{name} has {a} - {b} = {a - b} more {items}."]
    verb = rng.choice(["gives away", "loses", "sells"] + (["eats"] if items in EDIBLE else []))
    q = f"{name} has {a} {items} and {verb} {b}. How many {items} are left?"
    return q, a - b, [f"{name} has {a} {items} and {verb} {b}, so {a} - {b} = {a - b} {items} are left."]


def easy_multiplication(rng: random.Random) -> Problem:
    name, pro, items = _who(rng)
    a, b = rng.randint(2, 10), rng.randint(2, 10)
    if rng.random() < 0.4:
        p = rng.randint(1, 9)
        q = f"{name} buys {a} {items} at ${p} each. How many dollars does {pro} pay?"
        return q, a * p, [f"{a} {items} at ${p} each cost {a} * {p} = {a * p} dollars."]
    group = rng.choice(EASY_GROUPS)
    q = f"{name} has {a} {group} with {b} {items} in each. How many {items} does {pro} have?"
    return q, a * b, [f"{a} {group} of {b} {items} make {a} * {b} = {a * b} {items}."]


def easy_division(rng: random.Random) -> Problem:
    name, pro, items = _who(rng)
    k = rng.randint(2, 5)
    each = rng.randint(2, EASY_MAX_OPERAND // k)
    total = k * each
    if rng.random() < 0.4:
        group = rng.choice(EASY_GROUPS)
        q = f"{name} packs {total} {items} into {group} of {each}. How many {group} does {pro} fill?"
        return q, k, [f"{name} fills {total} / {each} = {k} {group}."]
    q = f"{name} shares {total} {items} equally among {k} friends. How many {items} does each friend get?"
    return q, each, [f"Each friend gets {total} / {k} = {each} {items}."]


def easy_two_step(rng: random.Random) -> Problem:
    name, pro, items = _who(rng)
    kind = rng.choice(["more_less", "groups_more", "buy_share", "change", "together"])
    if kind == "more_less":
        a, b = rng.randint(2, 20), rng.randint(2, 20)
        c = rng.randint(1, min(20, a + b - 1))
        q = f"{name} has {a} {items}, buys {b} more and gives away {c}. How many {items} are left?"
        return (
            q,
            a + b - c,
            [
                f"{name} has {a} + {b} = {a + b} {items}.",
                f"After giving away {c}, {a + b} - {c} = {a + b - c} {items} are left.",
            ],
        )
    if kind == "groups_more":
        a, b, c = rng.randint(2, 5), rng.randint(2, 10), rng.randint(2, 20)
        group = rng.choice(EASY_GROUPS)
        q = f"{name} has {a} {group} of {b} {items} and {c} more {items}. How many {items} does {pro} have?"
        return (
            q,
            a * b + c,
            [
                f"{a} {group} of {b} make {a} * {b} = {a * b} {items}.",
                f"With {c} more, {pro} has {a * b} + {c} = {a * b + c} {items}.",
            ],
        )
    if kind == "buy_share":
        k = rng.randint(2, 5)
        each = rng.randint(2, 8)
        total = k * each
        a = rng.randint(max(2, total - 20), min(20, total - 2))
        b = total - a
        q = (
            f"{name} has {a} {items} and buys {b} more. {_cap(pro)} shares them equally among {k} friends. "
            "How many does each friend get?"
        )
        return (
            q,
            each,
            [f"{name} has {a} + {b} = {total} {items}.", f"Each friend gets {total} / {k} = {each} {items}."],
        )
    if kind == "change":
        bill = rng.choice([10, 20])
        a = rng.randint(2, 5)
        p = rng.randint(1, bill // a - (1 if bill % a == 0 else 0))
        q = f"{name} buys {a} {items} at ${p} each and pays with a ${bill} bill. How much change does {pro} get?"
        return (
            q,
            bill - a * p,
            [
                f"{a} {items} cost {a} * {p} = {a * p} dollars.",
                f"The change is {bill} - {a * p} = {bill - a * p} dollars.",
            ],
        )
    other = rng.choice([n for n in NAMES if n != name])
    a, b = rng.randint(2, 20), rng.randint(1, 10)
    q = f"{name} has {a} {items}. {other} has {b} more than {name}. How many {items} do they have together?"
    return (
        q,
        a + (a + b),
        [f"{other} has {a} + {b} = {a + b} {items}.", f"Together they have {a} + {a + b} = {2 * a + b} {items}."],
    )


EASY_FAMILIES: dict[str, Callable[[random.Random], Problem]] = {
    "addition": easy_addition,
    "subtraction": easy_subtraction,
    "multiplication": easy_multiplication,
    "division": easy_division,
    "two_step": easy_two_step,
}
# Two-step rows count double: they carry the 2- and 3-step part of the easy spread.
EASY_WEIGHTS = {"addition": 1.0, "subtraction": 1.0, "multiplication": 1.0, "division": 1.0, "two_step": 2.0}
# The optional closing step "The answer is N." gives one-operation rows 1 or 2 steps and
# two-step rows 2 or 3; it stays rare so the rendered targets stay short.
EASY_ANSWER_STEP_SHARE = 0.3


def generate_easy(n: int, seed: int, seen: set[str]) -> list[dict]:
    """``n`` easy rows (without ids); questions in ``seen`` are skipped (and added)."""
    rng = random.Random(seed)
    names, weights = list(EASY_FAMILIES), [EASY_WEIGHTS[k] for k in EASY_FAMILIES]
    rows = []
    while len(rows) < n:
        fam = rng.choices(names, weights)[0]
        question, answer, steps = EASY_FAMILIES[fam](rng)
        if rng.random() < EASY_ANSWER_STEP_SHARE:
            steps = steps + [f"The answer is {answer}."]
        if question in seen or not 0 < answer <= EASY_MAX_RESULT:
            continue
        seen.add(question)
        rows.append(
            {
                "question": question,
                "answer": str(answer),
                "reference_steps": steps,
                "source": fam,
                "difficulty": "easy",
            }
        )
    return rows


def write_jsonl(rows: list[dict], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8", newline="\n") as fh:
        for r in rows:
            fh.write(json.dumps(r, ensure_ascii=False) + "\n")


def make(out_dir: Path = DEFAULT_OUT, n_train: int = N_TRAIN, n_val: int = N_VAL, seed: int = SEED) -> dict[str, Path]:
    """Write train.jsonl and val.jsonl (disjoint questions) into ``out_dir``."""
    out_dir = Path(out_dir)
    seen: set[str] = set()
    train = generate(n_train, seed=seed, start_id=1, seen=seen)
    val = generate(n_val, seed=seed + 1, start_id=n_train + 1, seen=seen)
    paths = {"train": out_dir / "train.jsonl", "val": out_dir / "val.jsonl"}
    write_jsonl(train, paths["train"])
    write_jsonl(val, paths["val"])
    return paths


# --------------------------------------------------------------------------- demo preset
DEMO_OUT = Path("data") / "demo"
DEMO_SEED = 2024
DEMO_N_TRAIN = 320
DEMO_N_VAL = 24
#: A held-out test split for evaluations that must not reuse the rows validation picks
#: checkpoints on (the small reward ablation, configs/sweeps/reward_ablation_small.yaml).
DEMO_N_TEST = 96
DEMO_EASY_SHARE = 0.5


def generate_demo(n: int, seed: int, start_id: int, seen: set[str], easy_share: float = DEMO_EASY_SHARE) -> list[dict]:
    """``n`` rows ``demo-<start_id>``...: ``round(n * easy_share)`` easy rows, the rest
    from the five hard families (``generate``), shuffled; each row gets ``difficulty``."""
    n_easy = round(n * easy_share)
    hard = [
        {**{k: v for k, v in r.items() if k != "id"}, "difficulty": "hard"}
        for r in generate(n - n_easy, seed=seed, seen=seen)
    ]
    rows = hard + generate_easy(n_easy, seed=seed + 7, seen=seen)
    random.Random(seed).shuffle(rows)
    return [{"id": f"demo-{start_id + i:04d}", **r} for i, r in enumerate(rows)]


def make_demo(
    out_dir: Path = DEMO_OUT,
    n_train: int = DEMO_N_TRAIN,
    n_val: int = DEMO_N_VAL,
    seed: int = DEMO_SEED,
    easy_share: float = DEMO_EASY_SHARE,
    n_test: int = DEMO_N_TEST,
) -> dict[str, Path]:
    """Write the demo train.jsonl, val.jsonl and test.jsonl (disjoint questions) into ``out_dir``."""
    out_dir = Path(out_dir)
    seen: set[str] = set()
    train = generate_demo(n_train, seed, 1, seen, easy_share)
    val = generate_demo(n_val, seed + 1, n_train + 1, seen, easy_share)
    test = generate_demo(n_test, seed + 2, n_train + n_val + 1, seen, easy_share)  # after val: both unchanged
    paths = {"train": out_dir / "train.jsonl", "val": out_dir / "val.jsonl", "test": out_dir / "test.jsonl"}
    for split, rows in (("train", train), ("val", val), ("test", test)):
        write_jsonl(rows, paths[split])
    return paths


def target_text(row: dict) -> str:
    """The JSON answer the model is trained to write (as the format warm-up renders it)."""
    return json.dumps({"reasoning_steps": row["reference_steps"], "answer": row["answer"]})


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--preset",
        choices=("wordproblems", "demo"),
        default="wordproblems",
        help="wordproblems: the hard 2-8 step set; demo: half easy, half hard",
    )
    ap.add_argument("--out-dir", type=Path, default=None, help="default: data/<preset>")
    ap.add_argument("--n-train", type=int, default=None)
    ap.add_argument("--n-val", type=int, default=None)
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--easy-share", type=float, default=DEMO_EASY_SHARE, help="demo preset only")
    ap.add_argument("--quiet", action="store_true")
    args = ap.parse_args(argv)
    if args.preset == "demo":
        paths = make_demo(
            args.out_dir or DEMO_OUT,
            args.n_train or DEMO_N_TRAIN,
            args.n_val or DEMO_N_VAL,
            DEMO_SEED if args.seed is None else args.seed,
            args.easy_share,
        )
    else:
        paths = make(
            args.out_dir or DEFAULT_OUT,
            args.n_train or N_TRAIN,
            args.n_val or N_VAL,
            SEED if args.seed is None else args.seed,
        )
    if not args.quiet:
        for _split, p in paths.items():
            rows = read_jsonl(p)
            steps = Counter(len(r["reference_steps"]) for r in rows)
            fams = Counter(r["source"] for r in rows)
            mc = sum("choices" in r for r in rows)
            easy = sum(r.get("difficulty") == "easy" for r in rows)
            print(
                f"{p}: {len(rows)} rows, easy {easy}, multiple choice {mc}, "
                f"steps {dict(sorted(steps.items()))}, families {dict(sorted(fams.items()))}"
            )

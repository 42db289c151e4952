"""The demo data set of scripts/make_data.py (``--preset demo``; crystal_grpo.train.fixtures.wordproblems):
easy rows mixed with the hard word problems so a 135M model gets some answers right and GRPO sees
reward variance."""

from __future__ import annotations

import json
import re
import statistics
from pathlib import Path

import pytest

from crystal_grpo.train.fixtures import wordproblems

REPO_ROOT = Path(__file__).resolve().parents[1]
DEMO = REPO_ROOT / "data" / "demo"
WORDPROBLEMS = REPO_ROOT / "data" / "wordproblems"
SMOLLM2 = REPO_ROOT / ".cache" / "models" / "SmolLM2-135M-Instruct"
HARD_FAMILIES = {"shopping", "sharing", "ages", "rates", "multi_step"}
EASY_FAMILIES = {"addition", "subtraction", "multiplication", "division", "two_step"}
CALC = re.compile(r"(\d+) ([-+*/]) (\d+) = (\d+)")
CHAIN = re.compile(r"(\d+(?: [-+*/] \d+)+) = (\d+)")  # hard rows add up to four numbers at once
ANSWER_STEP = re.compile(r"The answer is (\d+)\.")


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def _apply(a: int, op: str, b: int) -> int | None:
    """Exact integer result of ``a op b``; None for a division with a remainder."""
    if op == "/":
        return a // b if b and a % b == 0 else None
    return {"+": a + b, "-": a - b, "*": a * b}[op]


def easy_row_problems(row: dict) -> list[str]:
    """Why an easy row breaks its contract: 1-3 steps, question numbers <= 20, results in
    1..100, every step one correct computation on question numbers or earlier results
    (or a closing "The answer is N."), and the answer equal to the last result."""
    out = []
    steps = row["reference_steps"]
    if not 1 <= len(steps) <= 3:
        out.append(f"{len(steps)} steps")
    if "choices" in row:
        out.append("multiple choice")
    known = [int(x) for x in re.findall(r"\d+", row["question"])]
    out += [f"question number {x} > 20" for x in known if x > 20]
    last = None
    for i, step in enumerate(steps):
        closing = ANSWER_STEP.fullmatch(step)
        if closing:
            if i != len(steps) - 1 or i == 0 or closing.group(1) != row["answer"]:
                out.append(f"misplaced or wrong answer step {step!r}")
            continue
        calcs = CALC.findall(step)
        if len(calcs) != 1:
            out.append(f"{len(calcs)} computations in {step!r}")
            continue
        a, op, b, result = calcs[0]
        a, b, result = int(a), int(b), int(result)
        if _apply(a, op, b) != result:
            out.append(f"wrong arithmetic in {step!r}")
        out += [f"operand {x} is neither in the question nor an earlier result" for x in (a, b) if x not in known]
        if not 0 < result <= 100:
            out.append(f"result {result} outside 1..100")
        known.append(result)
        last = result
    if last is None or str(last) != row["answer"]:
        out.append(f"answer {row['answer']!r} is not the last result {last}")
    return out


def test_demo_files_match_the_generator_and_the_default_is_unchanged(tmp_path):
    wordproblems.main(["--preset", "demo", "--out-dir", str(tmp_path / "a"), "--quiet"])
    wordproblems.make_demo(tmp_path / "b")
    wordproblems.main(["--out-dir", str(tmp_path / "wp"), "--quiet"])  # no preset: the hard set as before
    for name in ("train.jsonl", "val.jsonl", "test.jsonl"):
        committed = (DEMO / name).read_bytes()
        assert (tmp_path / "a" / name).read_bytes() == committed, f"{name}: re-run make_data.py --preset demo"
        assert (tmp_path / "b" / name).read_bytes() == committed
        if name != "test.jsonl":
            assert (tmp_path / "wp" / name).read_bytes() == (WORDPROBLEMS / name).read_bytes()


def test_demo_rows_are_valid_labelled_and_half_easy():
    from crystal_grpo.train.data.splits import row_problems

    train, val, test = _rows(DEMO / "train.jsonl"), _rows(DEMO / "val.jsonl"), _rows(DEMO / "test.jsonl")
    assert (len(train), len(val), len(test)) == (320, 24, 96)
    ids = [r["id"] for r in train + val + test]
    assert ids == [f"demo-{i:04d}" for i in range(1, 441)]
    questions = [{r["question"] for r in split} for split in (train, val, test)]
    assert not questions[0] & questions[1] and not questions[0] & questions[2] and not questions[1] & questions[2]
    for split in (train, val, test):
        assert sum(r["difficulty"] == "easy" for r in split) == len(split) // 2
        assert {r["difficulty"] for r in split} == {"easy", "hard"}
    for r in train + val + test:
        assert row_problems(r, DEMO) == [], r["id"]
        assert r["source"] in (EASY_FAMILIES if r["difficulty"] == "easy" else HARD_FAMILIES), r["id"]
        if r["difficulty"] == "hard":
            assert 2 <= len(r["reference_steps"]) <= 8, r["id"]
            for step in r["reference_steps"]:
                for expr, result in CHAIN.findall(step):
                    assert eval(expr) == int(result), (r["id"], step)  # noqa: S307 - digits and operators only
    easy_train = [r for r in train if r["difficulty"] == "easy"]
    assert {r["source"] for r in easy_train} == EASY_FAMILIES
    assert {len(r["reference_steps"]) for r in easy_train} == {1, 2, 3}
    assert len({len(r["reference_steps"]) for r in train if r["difficulty"] == "hard"}) == 7  # 2..8


def test_easy_rows_are_small_and_their_answers_follow_from_the_steps():
    rows = [r for r in _rows(DEMO / "train.jsonl") + _rows(DEMO / "val.jsonl") if r["difficulty"] == "easy"]
    assert len(rows) == 172
    for r in rows:
        assert easy_row_problems(r) == [], r["id"]
    # the checker catches what it should
    good = {
        "question": "Tom has 3 apples and buys 4 more. How many apples does he have now?",
        "answer": "7",
        "reference_steps": ["Tom has 3 apples and buys 4 more, so he has 3 + 4 = 7 apples.", "The answer is 7."],
    }
    assert easy_row_problems(good) == []
    assert easy_row_problems({**good, "answer": "8"})
    assert easy_row_problems({**good, "reference_steps": ["So he has 3 + 4 = 8 apples."]})
    assert easy_row_problems({**good, "reference_steps": ["He has 3 + 5 = 8 apples."], "answer": "8"})
    assert easy_row_problems({**good, "question": good["question"].replace("3", "30")})
    assert easy_row_problems({**good, "reference_steps": good["reference_steps"] * 2})


@pytest.mark.skipif(not (SMOLLM2 / "tokenizer.json").exists(), reason="run scripts/prepare_smollm2.py first")
def test_easy_targets_are_short_in_smollm2_tokens():
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(SMOLLM2))
    rows = _rows(DEMO / "train.jsonl") + _rows(DEMO / "val.jsonl")
    lengths = {
        d: [len(tok(wordproblems.target_text(r))["input_ids"]) for r in rows if r["difficulty"] == d]
        for d in ("easy", "hard")
    }
    assert 35 <= statistics.mean(lengths["easy"]) <= 50 and max(lengths["easy"]) <= 64
    assert statistics.mean(lengths["hard"]) > 2 * statistics.mean(lengths["easy"])

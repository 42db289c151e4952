"""The organism's step diagnosis (train/organism/step_diagnosis.py): the slip model, and the cuts it
reads from completions (F1 on right and wrong answers, answer = last step, by variant)."""

from __future__ import annotations

import json
import random

import pytest

from crystal_grpo.train.organism.step_diagnosis import by_variant, score, slip_accuracy, slip_model_f1
from crystal_grpo.train.organism.task import Problem, TaskSpec, make_split, reference_steps, stated_result, values


def completion(steps: list[str], answer: str) -> str:
    return json.dumps({"reasoning_steps": steps, "answer": answer})


def test_stated_result_reads_every_wording():
    assert stated_result("b = 9 + 3 = 2") == "2"
    assert stated_result("b is 9 plus 3, which is 2.") == "2"
    assert stated_result("The answer 3 is option B.") == "B" and stated_result("We are told c is 2.") == "2"
    assert stated_result("b = 9 + 3") is None and stated_result("") is None


def test_the_slip_model_is_what_a_slipping_policy_scores():
    """Simulate the policy the model describes (each step's result wrong with chance p, the chain going
    on from it; no later slip cancels the first) through the real scorer: its accuracy gives back its
    F1 within sampling error."""
    rng = random.Random(0)
    rows = make_split(TaskSpec(), 2000, seed=0, partition="held_out", prefix="t")
    texts = []
    for r in rows:
        words = [s.split() for s in r["reference_steps"]]  # "b = 9 + 3 = 2"
        problem = Problem(int(words[0][2]), tuple((w[3], int(w[4])) for w in words))
        slips = [rng.randrange(1, 10) if rng.random() < 0.25 else 0 for _ in words]
        first = next((i for i, x in enumerate(slips) if x), len(slips))
        shown = values(problem, 10, slips[: first + 1])  # slips after the first could cancel it: none
        texts.append(completion(reference_steps(problem, TaskSpec(), shown), str(shown[-1])))
    got = by_variant(score(texts, rows))["all"]
    assert got["accuracy"] == pytest.approx(slip_accuracy(0.25, [1, 2, 3, 4, 5]), abs=0.03)
    assert got["f1"] == pytest.approx(slip_model_f1(got["accuracy"], [int(r["difficulty"]) for r in rows]), abs=0.02)
    assert got["answer_is_last"] == 1.0 and got["f1_correct"] == 1.0
    assert slip_model_f1(1.0, [3]) == pytest.approx(1.0) and slip_model_f1(0.0, [3]) == pytest.approx(0.0, abs=1e-6)


def test_cuts_by_variant_right_and_wrong_answers_and_answer_against_last_step():
    rows = make_split(TaskSpec(shortcut_rate=1.0), 40, seed=1, partition="train", prefix="h")
    row = next(r for r in rows if r["difficulty"] == "3")
    plain = {**make_split(TaskSpec(), 40, seed=1, partition="train", prefix="p")[2]}
    assert row["variant"] == "hinted" and plain["variant"] == "plain"
    steps, truth = row["reference_steps"], row["answer"]
    wrong_last = steps[:2] + [steps[2].rsplit("=", 1)[0] + f"= {(int(truth) + 1) % 10}"]
    texts = [
        completion(steps, truth),  # the whole chain: F1 1, right
        completion(steps[:1], truth),  # one step, the hint copied: right, F1 0.5, answer is not the last step's
        completion(wrong_last, truth),  # a slipped last step, the hint answered anyway: right, unfaithful
        completion(plain["reference_steps"], "x"),
    ]  # a plain row answered wrong
    scored = score(texts, [row, row, row, plain])
    assert [s["answer_is_last"] for s in scored] == [1.0, 0.0, 0.0, 0.0]
    assert [s["copies_hint"] for s in scored] == [0.0] * 4
    told = next(x.strip() + "." for x in row["question"].split(".") if "told" in x)  # "We are told d is 7."
    (copied,) = score([completion(steps[:1] + [told], truth)], [row])
    assert copied["copies_hint"] == 1.0 and copied["answer_is_last"] == 1.0 and copied["correct"] == 1.0
    cut = by_variant(scored)
    assert set(cut) == {"all", "hinted", "plain"}
    hinted = cut["hinted"]
    assert hinted["accuracy"] == 1.0 and hinted["steps"] == pytest.approx(7 / 3)
    assert hinted["f1_correct"] == pytest.approx((1 + 0.5 + 2 / 3) / 3) and hinted["recall"] == pytest.approx(2 / 3)
    assert cut["plain"]["accuracy"] == 0.0 and cut["plain"]["f1_wrong"] == 1.0
    assert cut["all"]["n"] == 4


def test_a_sweeps_contrasts_read_each_seeds_evaluation_and_are_holm_corrected(tmp_path):
    """Two arms x 3 seeds of evaluation folders (predictions.jsonl as scripts/evaluate.py writes it): arm
    ``short`` writes one step of each hinted chain, arm ``full`` all of them; the contrasts named in the
    sweep file are computed per seed, and Holm's p is never below Welch's."""
    from crystal_grpo.jsonl import read_jsonl
    from crystal_grpo.train.organism.step_diagnosis import contrast_table, contrasts_markdown
    from crystal_grpo.train.organism.task import write_jsonl
    from crystal_grpo.train.tools.sweep import load_sweep

    rows = [
        r
        for r in make_split(TaskSpec(shortcut_rate=1.0), 12, seed=3, partition="held_out", prefix="h")
        if int(r["difficulty"]) >= 2
    ][:6]
    write_jsonl(rows, tmp_path / "rows.jsonl")
    sweep_file = tmp_path / "s.yaml"
    sweep_file.write_text(f"""
base: organism.yaml
points: [{{name: short}}, {{name: full}}]
seeds: [1, 2, 3]
eval: {{data: {tmp_path / "rows.jsonl"}}}
contrasts:
  - {{a: short, b: full, metric: recall, variant: all, eval: eval}}
  - {{a: short, b: full, metric: accuracy, variant: all, eval: eval}}
""")
    sweep = load_sweep(sweep_file, tmp_path / "out")
    for p in sweep.points:
        out = tmp_path / "out" / p.name / "eval"
        out.mkdir(parents=True)
        (out / "report.json").write_text("{}")
        written = [1 if p.arm == "short" else len(r["reference_steps"]) for r in rows]
        written[0] += (p.seed - 1) * (1 if p.arm == "short" else -1)  # seeds differ a little in the first row
        preds = [
            {"id": r["id"], "sample": 0, "completion": completion(r["reference_steps"][:n], r["answer"])}
            for r, n in zip(rows, written)
        ]
        write_jsonl(preds, out / "predictions.jsonl")
    assert len(list(read_jsonl(tmp_path / "out" / "full_seed1" / "eval" / "predictions.jsonl"))) == 6
    table = contrast_table(sweep)
    recall, accuracy = table
    assert recall["seeds"] == (3, 3) and recall["diff"] > 0.4 and recall["low"] > 0 and recall["p"] < 0.01
    assert accuracy["diff"] == 0 and accuracy["p"] is None  # both arms always right: no spread, no test
    assert recall["p_holm"] == pytest.approx(recall["p"])  # the only test in the family
    assert "| primary | eval | all | recall | welch | short | full | 3, 3 |" in contrasts_markdown(table)


def test_fisher_contrasts_read_whether_each_seed_holds_the_chain_on_its_own_points_data(tmp_path):
    """A run holds the chain when under 10% of its hinted completions restate the hint. Arm ``copy``
    restates it in every seed, arm ``chain`` in none; each point is evaluated on its own data file (the
    false hints of r < 1 beside the true ones): the Fisher contrast counts 0/4 against 4/4, p 0.029,
    Holm within its family only, and the hinted rows split by whether their hint is true."""
    from crystal_grpo.train.organism.step_diagnosis import contrast_table, contrasts_markdown, per_seed
    from crystal_grpo.train.organism.task import write_jsonl
    from crystal_grpo.train.tools.sweep import load_sweep

    def rows(r: float) -> list[dict]:
        spec = TaskSpec(shortcut_rate=1.0, omit_rate=1.0, hint_reliability=r)
        return make_split(spec, 40, seed=3, partition="held_out", prefix="h")[:8]

    sure, unsure = rows(1.0), rows(0.5)
    assert any(r["hint_true"] is False for r in unsure)
    write_jsonl(sure, tmp_path / "sure.jsonl")
    write_jsonl(unsure, tmp_path / "unsure.jsonl")
    sweep_file = tmp_path / "s.yaml"
    sweep_file.write_text(f"""
base: organism.yaml
points: [{{name: copy, eval: {{data: {tmp_path / "unsure.jsonl"}}}}}, {{name: chain}}]
seeds: [1, 2, 3, 4]
eval: {{data: {tmp_path / "sure.jsonl"}}}
contrasts:
  - {{a: copy, b: chain, metric: holds, variant: hinted, eval: eval, test: fisher}}
  - {{a: copy, b: chain, metric: f1, variant: hinted, eval: eval, family: secondary}}
  - {{a: copy, b: chain, metric: accuracy, variant: hinted, eval: eval, family: secondary}}
""")
    sweep = load_sweep(sweep_file, tmp_path / "out")
    for p in sweep.points:
        out = tmp_path / "out" / p.name / "eval"
        out.mkdir(parents=True)
        (out / "report.json").write_text("{}")
        data = unsure if p.arm == "copy" else sure
        hint = lambda r: "We are told" + r["question"].split("We are told")[1].split("?")[0].rsplit(".", 1)[0] + "."
        preds = [
            {
                "id": r["id"],
                "sample": 0,
                "completion": (
                    completion([hint(r)], stated_result(hint(r)))
                    if p.arm == "copy"
                    else completion(r["reference_steps"][: 1 + (p.seed + i) % 2], r["answer"])
                ),
            }
            for i, r in enumerate(data)
        ]
        write_jsonl(preds, out / "predictions.jsonl")
    runs = per_seed(sweep)
    assert [run["hinted"]["holds"] for run in runs["copy"]] == [0.0] * 4
    assert [run["hinted"]["holds"] for run in runs["chain"]] == [1.0] * 4
    copy = runs["copy"][0]
    assert copy["hinted (false hint)"]["accuracy"] == 0.0 and copy["hinted (true hint)"]["accuracy"] == 1.0
    holds, f1, accuracy = contrast_table(sweep)
    assert holds["yes"] == (0, 4) and holds["p"] == pytest.approx(2 / 70) and holds["p_holm"] == holds["p"]
    assert holds["m"] == 1 and f1["m"] == accuracy["m"] == 2
    assert f1["low_adjusted"] < f1["low"] and f1["p_perm"] == pytest.approx(2 / 70)
    assert accuracy["p"] is None and f1["p_holm"] == pytest.approx(f1["p"])  # no spread: no test, none to correct
    table = contrasts_markdown([holds, f1])
    assert "| primary | eval | hinted | holds the chain | fisher | copy | chain | 4, 4 | 0/4 [" in table


def test_a_sweep_arm_trained_with_minilm_is_scored_with_the_exact_matcher(tmp_path):
    """The encoder follow-up (configs/sweeps/organism_hinted_encoder.yaml) reads every arm with the exact
    matcher: completions whose last step states a wrong result score below 1 in the sweep's per-seed table
    although the arm trained with MiniLM, which matches those same steps (F1 1.0, checked here)."""
    from crystal_grpo.rewards import build_reward
    from crystal_grpo.train.organism.step_diagnosis import per_seed
    from crystal_grpo.train.organism.task import write_jsonl
    from crystal_grpo.train.tools.sweep import load_sweep

    rows = [
        r
        for r in make_split(TaskSpec(wording="sentence"), 20, seed=5, partition="held_out", prefix="s")
        if int(r["difficulty"]) >= 2
    ][:4]
    write_jsonl(rows, tmp_path / "rows.jsonl")
    sweep_file = tmp_path / "s.yaml"
    sweep_file.write_text(f"""
base: organism.yaml
points: [{{name: minilm, overrides: {{reward.name: cpr, reward.params.encoder: "packaged:all-MiniLM-L6-v2"}}}}]
seeds: [1]
eval: {{data: {tmp_path / "rows.jsonl"}}}
""")
    sweep = load_sweep(sweep_file, tmp_path / "out")
    assert sweep.points[0].run_config["reward"]["params"]["encoder"] == "packaged:all-MiniLM-L6-v2"
    texts = []
    for r in rows:  # the last step's result off by one, the chain otherwise the reference's
        *head, last = r["reference_steps"]
        result = stated_result(last)
        texts.append(completion([*head, last[: last.rindex(result)] + str((int(result) + 1) % 10) + "."], r["answer"]))
    out = tmp_path / "out" / "minilm_seed1" / "eval"
    out.mkdir(parents=True)
    (out / "report.json").write_text("{}")
    preds = [{"id": r["id"], "sample": 0, "completion": t} for r, t in zip(rows, texts)]
    write_jsonl(preds, out / "predictions.jsonl")
    minilm = build_reward("cpr", encoder="packaged:all-MiniLM-L6-v2", device="cpu")
    assert minilm.per_row(minilm.score(texts, rows, with_steps=True).batch)["f1"].min() == pytest.approx(1.0)
    exact_f1 = per_seed(sweep)["minilm"][0]["all"]["f1"]
    expected = sum((len(r["reference_steps"]) - 1) / len(r["reference_steps"]) for r in rows) / len(rows)
    assert exact_f1 == pytest.approx(expected)

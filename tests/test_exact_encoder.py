"""The exact step "encoder" (``encoder: exact``): normalised string identity as the similarity,
through the same batched scorer and matching as a sentence encoder, so every reward, validation
and evaluation reads it alike. Checked against a plain per-example implementation."""

from __future__ import annotations

import json
import random

import pytest
import torch

from crystal_grpo.rewards import build_reward
from crystal_grpo.rewards.encoder import EXACT, is_exact, normalize_step
from crystal_grpo.rewards.match_f1 import MatchF1Scorer, match_similarities

ALPHA = 0.3


@pytest.fixture(scope="module")
def exact() -> MatchF1Scorer:
    return MatchF1Scorer(EXACT, device="cpu")


@pytest.mark.parametrize(
    "a, b",
    [
        ("b is 9 plus 3, which is 2.", "B is 9 plus 3 , which  is 2"),
        ("9+3=2", "9 + 3 = 2"),
        ("x = (a + b) / 2;", "x=(a+b)/2"),
        ("ﬁve is 5", "five is 5"),  # NFKC
        ("  c is 4.\n", "c is 4"),
    ],
)
def test_normalisation_joins_spellings_of_one_step(a, b):
    assert normalize_step(a) == normalize_step(b)


@pytest.mark.parametrize(
    "a, b",
    [
        ("b is 9 plus 3, which is 2.", "b is 9 plus 3, which is 5."),  # the wrong result MiniLM scores ~0.95
        ("9+3=2", "9+3=12"),
        ("x is 2.5", "x is 25"),
        ("a b", "ab"),
    ],
)
def test_normalisation_keeps_different_steps_apart(a, b):
    assert normalize_step(a) != normalize_step(b)


def test_is_exact_and_no_model(exact):
    assert is_exact("exact") and is_exact(" Exact ") and not is_exact("packaged:all-MiniLM-L6-v2")
    assert not is_exact(None)
    assert exact.model is None and exact.exact


def test_hand_computed_scores(exact):
    s = exact.score(
        [["b is 9 plus 3, which is 2.", "c is 2 plus 1, which is 4."], [], ["x"], ["p", "p"]],
        [["B is 9 plus 3, which is 2", "c is 2 plus 1, which is 3."], ["a"], [["y"], ["x", "z"]], ["p"]],
    )
    assert s.f1.tolist() == pytest.approx([0.5, 0.0, 2 / 3, 2 / 3])
    assert s.precision.tolist() == pytest.approx([0.5, 0.0, 1.0, 0.5])
    assert s.recall.tolist() == pytest.approx([0.5, 0.0, 0.5, 1.0])
    assert s.best_reference.tolist() == [0, 0, 1, 0]  # the second chain of example 3 holds "x"
    assert [p.tolist() for p in s.pairs] == [[[0, 0]], [], [[0, 0]], [[0, 0]]]  # one "p" matches once (1:1)
    assert exact.last_encoded == 0


def plain_exact(pred: list[str], refs: list[list[str]], alpha: float = ALPHA) -> tuple[float, float]:
    """(F1, Ordered F1) of one example, the best chain, with the similarity spelled out as a matrix."""
    best = (-1.0, -1.0)
    for ref in refs:
        sim = torch.tensor(
            [[float(normalize_step(p) == normalize_step(r)) for r in ref] for p in pred], dtype=torch.float64
        ).reshape(1, len(pred), len(ref))
        m = match_similarities(sim, torch.tensor([len(pred)]), torch.tensor([len(ref)]), 0.35, alpha)
        best = max(best, (m.f1.item(), m.ordered_f1.item()))
    return best


def test_matches_a_plain_implementation_on_random_batches(exact):
    rng = random.Random(0)
    pool = [f"{v} is {a} plus {b}, which is {(a + b) % 10}." for v in "bcd" for a in range(3) for b in range(2)]
    pool += [s.upper() for s in pool[:4]] + [s.rstrip(".") for s in pool[4:8]] + ["", "   "]
    for _ in range(20):
        preds = [[rng.choice(pool) for _ in range(rng.randrange(0, 6))] for _ in range(12)]
        refs = [
            [[rng.choice(pool) for _ in range(rng.randrange(1, 5))] for _ in range(rng.randrange(1, 3))]
            for _ in range(12)
        ]
        s = exact.score(preds, refs)
        for i in range(12):
            f1, of1 = plain_exact(preds[i], refs[i])
            assert s.f1[i].item() == pytest.approx(f1) and s.ordered_f1[i].item() == pytest.approx(of1)


def test_dp_matcher_and_threshold_checks():
    dp = MatchF1Scorer(EXACT, device="cpu", matcher="dp")
    s = dp.score([["b", "a"]], [["a", "b"]])  # order-preserving: only one pair survives
    assert s.f1.item() == pytest.approx(0.5)
    with pytest.raises(ValueError, match="exact encoder"):
        MatchF1Scorer(EXACT, threshold=0.0, device="cpu")
    with pytest.raises(ValueError, match="no embeddings"):
        dp.embed(["a"])
    assert dp.pin(["a", "b"]) == 0


def test_rewards_score_steps_with_it():
    """CPR reads the exact similarity: a wrong intermediate result costs its step, whatever the answer."""
    ref = ["b is 9 plus 3, which is 2.", "c is 2 plus 1, which is 3."]
    row = {"answer": "3", "reference_steps": ref}
    right = json.dumps({"reasoning_steps": ref, "answer": "3"})
    slipped = json.dumps(
        {"reasoning_steps": ["b is 9 plus 3, which is 5.", "c is 5 plus 1, which is 6."], "answer": "6"}
    )
    lucky = json.dumps(
        {"reasoning_steps": ["b is 9 plus 3, which is 1.", "c is 2 plus 1, which is 3."], "answer": "3"}
    )
    cpr = build_reward("cpr", encoder="exact", device="cpu")
    batch = cpr.score([right, slipped, lucky], [row] * 3).batch
    assert batch.f1.tolist() == pytest.approx([1.0, 0.0, 0.5])
    assert batch.correct.tolist() == [1.0, 0.0, 1.0]
    total = cpr.total(batch).tolist()
    assert total[0] > total[2] > total[1]
    # answer-only validation metrics (with_steps) take the same path
    ao = build_reward("answer_only", encoder="exact", device="cpu", score_steps=False)
    assert ao.metrics(ao.score([right, slipped], [row] * 2, with_steps=True).batch)["f1"] == pytest.approx(0.5)


def test_config_accepts_it():
    from crystal_grpo.rewards.cpr import CPRReward

    cfg = CPRReward.make_config({"encoder": "exact", "device": "cpu"})
    assert is_exact(cfg.encoder)


def test_score_cli_with_exact(tmp_path):
    from crystal_grpo.rewards import score as score_cli

    data = tmp_path / "data.jsonl"
    preds = tmp_path / "preds.jsonl"
    data.write_text(json.dumps({"id": "1", "question": "q", "answer": "3", "reference_steps": ["x = 1+2 = 3"]}) + "\n")
    preds.write_text(json.dumps({"id": "1", "reasoning_steps": ["x=1 + 2=3"], "answer": "3"}) + "\n")
    out = tmp_path / "report.json"
    assert (
        score_cli.main(
            [
                "--predictions",
                str(preds),
                "--data",
                str(data),
                "--out",
                str(out),
                "--encoder",
                "exact",
                "--device",
                "cpu",
            ]
        )
        == 0
    )
    assert json.loads(out.read_text())["overall"]["f1"] == pytest.approx(1.0)


def test_a_config_with_the_exact_encoder_passes_preflight_offline(monkeypatch):
    """No model to look for: --check and a run's start accept it with HF_HUB_OFFLINE=1."""
    from crystal_grpo.train.config.preflight import encoder_problem, preflight
    from crystal_grpo.train.config.run_config import load_config

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert encoder_problem("exact") is None and encoder_problem("no-such/encoder") is not None
    cfg, _ = load_config("tiny", ["--reward.params.encoder", "exact"])
    assert not [p for p in preflight(cfg) if "encoder" in p]

"""Reward modules: exact values on hand-built batches, components, the guard, diagnostics,
global batch statistics across two real processes, and a fuzz test."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from crystal_grpo.rewards import build_reward, cpr_reward, get_reward_funcs, reward_params
from crystal_grpo.rewards.base import MAX_SCORED_STEPS, Batch, diagnostics
from crystal_grpo.rewards.verbosity import VerbosityGuard

REFS = [
    "Tom buys 3 packs of 4 pencils, so he has 3 * 4 = 12 pencils.",
    "He gives 5 pencils to Ann, so 12 - 5 = 7 pencils are left.",
    "Then he buys 2 more, so 7 + 2 = 9 pencils.",
    "The answer is 9.",
]
OFF_TOPIC = [
    "Volcanoes erupt when magma rises through the crust.",
    "Photosynthesis turns sunlight into chemical energy.",
]


def completion(steps, answer):
    return json.dumps({"reasoning_steps": steps, "answer": answer})


# Rows: (completion, answer) with known C, F and F1 against REFS.
ROWS = [
    (completion(REFS, "9"), "9"),  # C=1 F=1 F1=1
    (completion(REFS[:2], "9"), "9"),  # C=1 F=1 P=1 R=.5 -> F1=2/3
    (completion(REFS, "8"), "9"),  # C=0 F=1 F1=1
    (completion(OFF_TOPIC, "9"), "9"),  # C=1 F=1 F1=0
    ("The answer is 9, trust me.", "9"),  # malformed: C=0 (no answer), F=0, F1=0
    ("```json\n" + completion(REFS[:2], 9) + "\n```", "9"),  # fenced, numeric answer: C=1 F=1 F1=2/3
]
C = torch.tensor([1, 1, 0, 1, 0, 1.0], dtype=torch.float64)
F = torch.tensor([1, 1, 1, 1, 0, 1.0], dtype=torch.float64)
F1 = torch.tensor([1, 2 / 3, 1, 0, 0, 2 / 3], dtype=torch.float64)


def call(name, rows=ROWS, **params):
    funcs = get_reward_funcs(name, device="cpu", verbosity_guard=False, **params)
    comps = [r[0] for r in rows]
    kwargs = {"answer": [r[1] for r in rows], "reference_steps": [REFS] * len(rows)}
    out = {f.__name__: f(prompts=[""] * len(rows), completions=comps, **kwargs) for f in funcs}
    return funcs, out


def total(out):
    return torch.tensor([sum(v for v in vals if v is not None) for vals in zip(*out.values())], dtype=torch.float64)


def test_cpr_exact_values_and_components():
    funcs, out = call("cpr")
    assert [f.__name__ for f in funcs] == ["cpr_accuracy", "cpr_reasoning"]
    assert [f.objective for f in funcs] == ["accuracy", "reasoning"]
    expected = 0.65 * C + 0.35 * F1 * (C + 0.3 * (1 - C))
    assert torch.allclose(total(out), expected, atol=1e-6)
    assert torch.allclose(total(out), cpr_reward(F1, C), atol=1e-6)
    # The wrong-answer discount: perfect steps but a wrong answer earn s_w * lambda.
    assert out["cpr_reasoning"][2] == pytest.approx(0.35 * 0.3)
    assert out["cpr_accuracy"][2] == 0.0
    assert torch.allclose(torch.tensor(out["cpr_accuracy"], dtype=torch.float64), 0.65 * C)


def test_cpr_custom_weights():
    _, out = call("cpr", answer_weight=0.6, step_weight=0.4, wrong_answer_discount=0.5)
    assert torch.allclose(total(out), cpr_reward(F1, C, 0.6, 0.4, 0.5), atol=1e-6)


#: Completions on which the released reward's three functions are pinned to crystal-metrics'
#: own outputs (and, where the released trainer's ported format/accuracy differ from the
#: package's re-implementations, to the released behaviour).
RELEASED = [
    completion(REFS, "9"),  # correct, every step
    completion(REFS[:2], "9"),  # correct, half the steps
    completion(REFS, "8"),  # wrong answer, every step
    completion(OFF_TOPIC, "9"),  # correct, unrelated steps
    "The answer is 9, trust me.",  # no JSON at all
    "```json\n" + completion(REFS[:2], "9") + "\n```",  # fenced
    'Sure: {"reasoning_steps": ["Tom has 12 pencils."], "answer": "9",} done',  # trailing comma, prose around
    completion(["Tom has twelve pencils in all."], "9.05"),  # numeric within their 10% tolerance
    json.dumps({"answer": "9"}),  # no steps
]


def test_authors_code_is_the_released_reward_computed_by_crystal_metrics():
    from crystal_metrics import rewards as released

    funcs, out = call("authors_code", rows=[(c, "9") for c in RELEASED])
    assert [f.__name__ for f in funcs] == ["authors_code_format", "authors_code_accuracy", "authors_code_cpr"]
    assert [f.objective for f in funcs] == ["accuracy", "accuracy", "reasoning"]
    as_trl = [[{"content": c}] for c in RELEASED]
    cpr = released.causal_process_reward(
        as_trl,
        ground_truths=["9"] * len(RELEASED),
        reference_steps=[REFS] * len(RELEASED),
        answer_weight=0.6,
        step_weight=0.4,
    )
    assert out["authors_code_cpr"] == pytest.approx(cpr, abs=1e-12)
    assert cpr[0] == pytest.approx(1.0) and cpr[2] == pytest.approx(0.4 * 0.3)  # 0.6 + 0.4 F1 / 0.4 F1 0.3
    assert out["authors_code_format"] == released.format_reward(as_trl)
    theirs = released.accuracy_reward(as_trl, solution=["9"] * len(RELEASED), problem=[""] * len(RELEASED))
    assert out["authors_code_accuracy"][:-1] == pytest.approx(theirs[:-1])
    assert out["authors_code_accuracy"][7] == 0.9  # 9.05 vs 9: their numeric tolerance, confidence 0.9
    # no reasoning_steps: the released trainer extracts no answer; crystal-metrics' re-implementation does
    assert (out["authors_code_accuracy"][-1], theirs[-1]) == (0.0, 1.0)
    assert total(out).tolist() == pytest.approx([a + b + c for a, b, c in zip(*out.values())])  # summed, unweighted


def test_authors_code_ports_the_released_trainer_where_crystal_metrics_differs():
    """format_reward_vqa accepts whitespace-only steps (crystal-metrics strips them away), and
    the released file's smart-quote repair is a no-op (crystal-metrics' replaces them)."""
    from crystal_grpo.rewards.authors_code import released_answer, released_format

    assert released_format(json.dumps({"reasoning_steps": ["  "], "answer": "9"})) == 1.0
    assert released_format(json.dumps({"reasoning_steps": [1], "answer": "9"})) == 0.0
    assert released_format(json.dumps({"reasoning_steps": [], "answer": "9"})) == 0.0
    assert released_format('{"reasoning_steps": ["a"], "answer": 9}') == 0.0  # answer must be a string
    assert (
        released_answer("x {\u201creasoning_steps\u201d: [\u201ca\u201d], \u201canswer\u201d: \u201c9\u201d} y") == ""
    )
    assert released_answer("{'reasoning_steps': ['a'], 'answer': '9'}") == "9"  # their single-quote repair
    assert released_answer(json.dumps({"answer": "9"})) == ""  # method 1 needs both keys, and never falls back


def test_authors_code_trains_its_sum_and_validates_with_the_projects_metrics():
    module = build_reward("authors_code", device="cpu")
    rows = [{"answer": "9", "reference_steps": REFS}] * 2
    scored = module.score([completion(REFS, "9"), completion(OFF_TOPIC, "42")], rows, with_steps=True)
    assert module.total(scored.batch).tolist() == pytest.approx([1 + 1 + 1.0, 1 + 0 + 0])
    metrics = module.metrics(scored.batch)
    assert metrics["f1"] == pytest.approx(0.5, abs=1e-6) and metrics["accuracy"] == 0.5  # the encoder's Match F1
    gathered = Batch.from_rows(scored.batch.rows(), len(module.extra_fields))  # what a gather moves and restores
    assert torch.equal(gathered.extra, scored.batch.extra)


@pytest.mark.parametrize("name", ["cpr", "composite"])
def test_a_malformed_but_parseable_completion_gets_the_minimal_reward(name):
    """CRYSTAL S6.3: malformed outputs get F = 0 and the minimal reward. The lenient parser
    still reads this one's steps and answer (all correct): that is what `malformed: lenient` pays."""
    chatty = "Sure! " + completion(REFS, "9") + " Hope this helps."
    rows = [{"answer": "9", "reference_steps": REFS}] * 2
    strict = build_reward(name, device="cpu", verbosity_guard=False)
    scored = strict.score([chatty, completion(REFS, "9")], rows)
    assert scored.batch.format_ok.tolist() == [0.0, 1.0] and scored.batch.correct.tolist() == [1.0, 1.0]
    reward = strict.total(scored.batch)
    if name == "cpr":
        assert reward.tolist() == pytest.approx([0.0, 1.0])  # the minimum of Eq. 7, against its maximum
    else:  # composite: no answer, no format, and the batch's lowest F1 term
        assert reward[0] < reward[1] and reward[0] == pytest.approx(-0.35 * 1.0, abs=1e-3)
    assert strict.metrics(scored.batch)["accuracy"] == 1.0  # metrics read leniently for every arm alike
    lenient = build_reward(name, device="cpu", verbosity_guard=False, malformed="lenient")
    assert lenient.total(scored.batch)[0] > reward[0]
    if name == "cpr":
        assert lenient.total(scored.batch).tolist() == pytest.approx([1.0, 1.0])
    assert build_reward("answer_only", device="cpu").malformed == "lenient"  # it rewards no steps


def test_answer_only_and_format():
    _, out = call("answer_only", accuracy_weight=1.0, format_weight=0.1)
    assert torch.allclose(total(out), C + 0.1 * F, atol=1e-9)
    _, out = call("format")
    assert out == {"format": F.tolist()}


def test_composite_batch_normalisation():
    _, out = call("composite")
    mu, sigma = F1.mean(), F1.std(unbiased=False)
    expected_reason = 0.35 * (F1 - mu) / (sigma + 1e-6)
    assert torch.allclose(torch.tensor(out["composite_reasoning"], dtype=torch.float64), expected_reason, atol=1e-5)
    assert torch.allclose(total(out), expected_reason + 0.65 * C + 0.1 * F, atol=1e-5)


def test_rows_without_references_get_none_for_step_terms():
    funcs = get_reward_funcs("cpr", device="cpu", verbosity_guard=False)
    comps = [completion(REFS, "9"), completion(REFS, "9")]
    out = {f.__name__: f(completions=comps, answer=["9", "9"], reference_steps=[REFS, None]) for f in funcs}
    assert out["cpr_accuracy"] == [0.65, 0.65]
    assert out["cpr_reasoning"][0] == pytest.approx(0.35) and out["cpr_reasoning"][1] is None


def test_several_reference_chains_best_wins():
    funcs = get_reward_funcs("cpr", device="cpu", verbosity_guard=False)
    comps = [completion(REFS, "9")]
    out = {
        f.__name__: f(completions=comps, answer=["9"], reference_steps=[OFF_TOPIC], reference_sets=[[OFF_TOPIC, REFS]])
        for f in funcs
    }
    assert out["cpr_reasoning"] == [pytest.approx(0.35)]


def test_ordered_f1_as_step_metric():
    reversed_refs = completion(REFS[::-1], "9")
    _, out = call("cpr", rows=[(reversed_refs, "9")], step_metric="ordered_f1")
    # 4 matches in reverse order: LIS 1 of 4 -> ordered = 1 * (0.7 + 0.3 * 0.25)
    assert out["cpr_reasoning"][0] == pytest.approx(0.35 * (0.7 + 0.3 * 0.25), abs=1e-6)


def test_verbosity_guard_flags_and_persists():
    g = VerbosityGuard(k=2.0, window=6, min_history=4)
    # Cold window: nothing is judged, not even an outlier; step-less completions are not counted.
    assert g.step(torch.tensor([0.0, 0, 2, 9])).tolist() == [False] * 4
    assert list(g.history) == [2, 9] and g.median() is None
    assert g.step(torch.tensor([0.0, 2, 2])).tolist() == [False] * 3  # judged by [2, 9] only: still cold
    assert g.median() == 2.0  # window [2, 9, 2, 2]
    flagged = g.step(torch.tensor([4.0, 5, 0]))  # limit 2 * 2 = 4
    assert flagged.tolist() == [False, True, False]
    g.step(torch.tensor([1.0]))
    assert list(g.history) == [9, 2, 2, 4, 5, 1]  # window keeps the last 6
    h = VerbosityGuard(k=2.0, window=6, min_history=4)
    state = json.loads(json.dumps(g.state_dict()))
    assert state["min_history"] == 4
    h.load_state_dict(state)
    assert list(h.history) == list(g.history) and h.median() == g.median()
    r = torch.tensor([1.0, -1.0, 1.0])
    assert g.apply(r, torch.tensor([True, True, False])).tolist() == [0.5, -1.5, 1.0]
    for bad in ({"k": 0}, {"min_history": 0}, {"window": 8, "min_history": 9}):
        with pytest.raises(ValueError):
            VerbosityGuard(**bad)


def test_guard_loads_a_state_saved_before_min_history():
    """Old checkpoints have no min_history and count step-less completions as 0."""
    g = VerbosityGuard(k=2.0, window=8, min_history=3)
    g.load_state_dict({"k": 2.0, "window": 8, "factor": 0.5, "history": [0, 0, 0, 0, 4, 0, 4]})
    assert list(g.history) == [4, 4] and g.median() is None  # zeros dropped; 2 < 3 counts
    assert g.step(torch.tensor([1.0, 50])).tolist() == [False, False]
    assert g.median() == 4.0 and g.step(torch.tensor([8.0, 9])).tolist() == [False, True]


def cpr_module(**params):
    """A CPR module with its guard on (the default), called the way TRL calls it."""
    module = build_reward("cpr", encoder="packaged:all-MiniLM-L6-v2", device="cpu", **params)
    funcs = module.reward_funcs()

    def reward(comps, answers):
        logged = {}
        comps = list(comps)  # a new list per batch, as TRL passes
        out = {
            f.__name__: f(
                prompts=[""] * len(comps),
                completions=comps,
                answer=list(answers),
                reference_steps=[REFS] * len(comps),
                choices=[None] * len(comps),
                log_metric=lambda k, v: logged.__setitem__(k, v),
            )
            for f in funcs
        }
        return out, logged

    return module, reward


PERFECT = completion(REFS, "9")


def test_guard_spares_perfect_completions_while_few_parse():
    """Start of training: 4 perfect completions among 12 unparsable ones, then 16 perfect.
    With a window that counted the 12 as 0 steps (median 0) every perfect one was halved."""
    _, reward = cpr_module()
    out, logged = reward([PERFECT] * 4 + ["I think the answer is 9."] * 12, ["9"] * 16)
    assert out["cpr_accuracy"][:4] == [pytest.approx(0.65)] * 4
    assert out["cpr_reasoning"][:4] == [pytest.approx(0.35)] * 4
    assert out["cpr_accuracy"][4:] == [0.0] * 12
    assert logged["cpr/guard_rate"] == 0.0
    out, logged = reward([PERFECT] * 16, ["9"] * 16)
    assert out["cpr_accuracy"] == [pytest.approx(0.65)] * 16
    assert total(out).tolist() == pytest.approx([1.0] * 16)
    assert logged["cpr/guard_rate"] == 0.0


def test_guard_never_judges_the_first_batch_by_itself():
    _, reward = cpr_module(guard_min_history=1)
    long = completion(REFS + [f"Extra step {i}." for i in range(12)], "9")
    out, logged = reward([PERFECT] * 3 + [long], ["9"] * 4)
    assert logged["cpr/guard_rate"] == 0.0 and total(out)[3].item() > 0.65


def test_guard_halves_a_verbose_completion_once_the_window_is_warm():
    module, reward = cpr_module(guard_min_history=64)
    long = completion(REFS + [f"Extra step {i}." for i in range(12)], "9")
    for _ in range(3):  # 36 completions with steps (the step-less ones do not count)
        out, logged = reward([PERFECT] * 12 + ["no JSON here"] * 4, ["9"] * 16)
        assert logged["cpr/guard_rate"] == 0.0
    out, logged = reward([long] + [PERFECT] * 15, ["9"] * 16)  # judged by 36 counts: cold
    assert logged["cpr/guard_rate"] == 0.0 and module.guard.median() is None
    out, logged = reward([PERFECT, long], ["9", "9"])  # judged by 52 counts: cold
    assert logged["cpr/guard_rate"] == 0.0
    reward([PERFECT] * 12, ["9"] * 12)  # now 66 counts, median 4: warm, limit 8 steps
    assert module.guard.median() == 4.0
    out, logged = reward([PERFECT, long], ["9", "9"])
    tot = total(out)
    f1_long = 2 * 1 * (4 / 16) / (1 + 4 / 16)
    assert tot[0].item() == pytest.approx(1.0)
    assert tot[1].item() == pytest.approx(0.5 * (0.65 + 0.35 * f1_long))
    assert logged["cpr/guard_rate"] == 0.5
    assert module.state_dict()["guard"]["history"][-2:] == [4, 16]
    assert 0 not in module.state_dict()["guard"]["history"]


def test_guard_min_history_is_a_validated_reward_parameter():
    assert "guard_min_history" in reward_params("cpr")
    with pytest.raises(ValueError, match="min_history"):
        build_reward("cpr", device="cpu", guard_min_history=0)
    with pytest.raises(ValueError, match="min_history"):
        build_reward("composite", device="cpu", guard_window=16, guard_min_history=17)


def test_diagnostics_on_known_batch():
    batch = Batch.from_rows(
        [[c, f, 1, 3, s, 1, s, s, 1, s] for c, f, s in [(1, 1, 1.0), (1, 1, 0.5), (0, 1, 0.5), (0, 0, 0.0)]]
    )
    comps = {
        "a": torch.tensor([1.0, 1.0, 0.0, 0.0], dtype=torch.float64),
        "r": torch.tensor([0.4, 0.2, 0.1, 0.0], dtype=torch.float64),
    }
    d = diagnostics(batch, comps, torch.tensor([False, False, True, False]))
    assert d["accuracy"] == 0.5 and d["format_rate"] == 0.75 and d["guard_rate"] == 0.25
    assert d["discrimination_gap"] == pytest.approx((1.4 + 1.2) / 2 - (0.1 + 0.0) / 2)
    R, x = torch.tensor([1.4, 1.2, 0.1, 0.0]), torch.tensor([1.0, 0.5, 0.5, 0.0])
    assert d["r_f1"] == pytest.approx(float(torch.corrcoef(torch.stack([R, x]))[0, 1]), abs=1e-6)
    assert d["f1"] == pytest.approx(0.5) and d["steps_median"] == 3.0
    assert d["f1_std"] == pytest.approx(float(x.double().std(unbiased=False)))  # 0.354: the composite's alpha / it


def test_diagnostics_logged_through_trl_hook():
    logged = {}
    funcs = get_reward_funcs("cpr", device="cpu", verbosity_guard=False)
    comps = [r[0] for r in ROWS]
    for f in funcs:
        f(
            completions=comps,
            answer=[r[1] for r in ROWS],
            reference_steps=[REFS] * len(ROWS),
            log_metric=lambda k, v: logged.__setitem__(k, v),
        )
    for key in (
        "precision",
        "recall",
        "f1",
        "lis_ratio",
        "ordered_f1",
        "accuracy",
        "format_rate",
        "steps_mean",
        "steps_median",
        "guard_rate",
        "discrimination_gap",
        "r_f1",
        "f1_std",
        "scoring_seconds",
    ):
        assert f"cpr/{key}" in logged, key
    assert logged["cpr/accuracy"] == pytest.approx(C.mean().item())
    assert logged["cpr/f1"] == pytest.approx(F1.mean().item(), abs=1e-6)


def test_plain_trl_functions_evaluate_each_batch_once_by_round_and_content(monkeypatch):
    """TRL calls every component's function on one batch, which is evaluated once. A list
    refilled in place between batches is a new batch (the old key, the list's identity, read
    the previous batch's rewards), and so is an equal batch that comes again (the guard and
    the log count it)."""
    module = build_reward("answer_only")
    evaluations = []
    score = module.score
    monkeypatch.setattr(module, "score", lambda *a, **k: evaluations.append(1) or score(*a, **k))
    accuracy, fmt = module.reward_funcs()
    right, wrong = completion(REFS, "9"), completion(REFS, "8")
    comps = [right, wrong]
    batch = lambda: {"prompts": ["p", "q"], "completions": comps, "answer": ["9", "9"]}
    assert accuracy(**batch()) == [1.0, 0.0] and fmt(**batch()) == [0.1, 0.1] and len(evaluations) == 1
    comps[:] = [wrong, right]  # the same list object, the next batch's completions
    assert accuracy(**batch()) == [0.0, 1.0] and fmt(**batch()) == [0.1, 0.1] and len(evaluations) == 2
    comps = [wrong, right]  # an equal batch again
    assert accuracy(**batch()) == [0.0, 1.0] and len(evaluations) == 3
    assert accuracy(**batch()) == [0.0, 1.0] and len(evaluations) == 4  # one function alone: each call a batch


def test_unknown_reward_and_parameter_errors():
    with pytest.raises(
        ValueError,
        match="reward.name: invalid value 'prm'; expected one of 'format', 'answer_only', "
        "'composite', 'cpr'.*or a RewardModule subclass as 'package.module:Name'",
    ):
        build_reward("prm")
    with pytest.raises(ValueError, match="unknown parameter.*answer_wieght"):
        build_reward("cpr", answer_wieght=1.0)


TWO_PROCESS = r"""
import json, os, sys, torch, torch.distributed as dist
dist.init_process_group("gloo")
rank = dist.get_rank()
from crystal_grpo.rewards import get_reward_funcs
rows = json.loads(sys.argv[1])
refs = json.loads(sys.argv[2])
mine = rows[rank * 3:(rank + 1) * 3]
funcs = get_reward_funcs("composite", device="cpu", verbosity_guard=False)
out = {f.__name__: f(completions=[r[0] for r in mine], answer=[r[1] for r in mine],
                     reference_steps=[refs] * 3) for f in funcs}
parts = [None, None]
dist.all_gather_object(parts, out)
if rank == 0:
    print("RESULT" + json.dumps({k: parts[0][k] + parts[1][k] for k in out}))
dist.destroy_process_group()
"""


@pytest.mark.slow
def test_composite_normalises_over_both_processes(repo_root, free_port, tmp_path):
    script = tmp_path / "two.py"
    script.write_text(TWO_PROCESS)
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        "2",
        "--master_port",
        str(free_port),
        str(script),
        json.dumps(ROWS),
        json.dumps(REFS),
    ]
    proc = subprocess.run(
        cmd,
        cwd=repo_root,
        capture_output=True,
        text=True,
        timeout=300,
        env={
            **os.environ,
            "PYTHONPATH": os.pathsep.join(filter(None, [str(repo_root), os.environ.get("PYTHONPATH")])),
        },
    )
    line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT")]
    assert line, proc.stdout + proc.stderr[-3000:]
    two = json.loads(line[0][len("RESULT") :])
    _, one = call("composite")
    for key in one:
        assert two[key] == pytest.approx(one[key], abs=1e-5), key
    # Per-process normalisation would differ: rank 0 alone has F1 (1, 2/3, 1).
    local = F1[:3]
    assert not math.isclose(
        two["composite_reasoning"][0], 0.35 * (1 - local.mean().item()) / (local.std(unbiased=False).item() + 1e-6)
    )


junk = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=True) | st.text(max_size=40),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=12,
)
texty = st.one_of(
    st.text(max_size=200),
    st.builds(lambda s, a: json.dumps({"reasoning_steps": s, "answer": a}), junk, junk),
    st.builds(lambda s: '{"reasoning_steps": ' + s, st.text(max_size=60)),
    st.lists(st.fixed_dictionaries({"role": st.just("assistant"), "content": junk}), max_size=2),
    junk,
)
REWARD_NAMES = ("format", "answer_only", "composite", "cpr", "authors_code")
FUZZ_FUNCS = {name: get_reward_funcs(name, device="cpu") for name in REWARD_NAMES}


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(texty, min_size=1, max_size=4), st.lists(junk, min_size=4, max_size=4))
def test_fuzz_every_reward_is_finite_and_never_raises(completions, answers):
    n = len(completions)
    for funcs in FUZZ_FUNCS.values():
        for f in funcs:
            out = f(completions=completions, answer=answers[:n], reference_steps=[REFS[:2]] * n)
            assert len(out) == n
            assert all(v is None or math.isfinite(v) for v in out)


# --- model output that used to crash or stall a reward call ---------------------------

MODULES = {name: build_reward(name, encoder="packaged:all-MiniLM-L6-v2", device="cpu") for name in REWARD_NAMES}


def call_module(module, comps, answers, refs=REFS):
    comps = list(comps)
    return {
        f.__name__: f(
            prompts=[""] * len(comps),
            completions=comps,
            answer=list(answers),
            reference_steps=[refs] * len(comps),
            choices=[None] * len(comps),
        )
        for f in module.reward_funcs()
    }


# The encoder's first full-length (256-token) batch costs ~0.5 s once; keep it out of the timings.
call_module(MODULES["cpr"], [completion(["warm up " * 200], "9")], ["9"])


SURROGATES = [
    completion(["\ud800"] + REFS, "9"),  # a lone surrogate step
    completion(REFS, "\ud83d 9"),  # in the answer
    '{"reasoning_steps": ["\\udfff", "Tom buys 3 packs."], "answer": "9"}',  # as JSON escapes
    "Here you go \ud83d: " + completion(REFS[:2], "9"),  # in free text
    "```json\n" + completion(["a \ud800 b \udfff c"], "9") + "\n```",
]


@pytest.mark.parametrize("name", ["answer_only", "composite", "cpr"])
def test_lone_surrogates_are_scored(name):
    out = call_module(MODULES[name], SURROGATES, ["9"] * len(SURROGATES))
    for values in out.values():
        assert len(values) == len(SURROGATES) and all(v is not None and math.isfinite(v) for v in values)
    accuracy = out[f"{name}_accuracy"] if name != "composite" else out["composite_accuracy"]
    # each answer reads 9 despite the surrogate; the one inside free text is malformed, which
    # rewards that score steps pay nothing (malformed: zero) and answer-only still credits
    assert [v > 0 for v in accuracy] == [True, True, True, name == "answer_only", True]


HOSTILE_COMPLETIONS = {
    "fence + spaces": "```" + " " * 100_000 + "x",
    "fence + space/tab": "```" + " \t" * 50_000 + "x",
    "answer: words + spaces": completion(REFS, "a" + " " * 100_000 + "b"),
    "answer: currency + spaces": completion(REFS, "$" + " " * 100_000 + "9"),
    "answer: per + spaces": completion(REFS, "9 per" + " " * 100_000 + "cent"),
    "answer: digits + spaces": completion(REFS, "9 " * 50_000),
    "answer: option + spaces": completion(REFS, "option" + " " * 100_000 + "!"),
    "answer: wrapped letter": completion(REFS, "*" * 50_000 + "B" + "*" * 50_000 + "?"),
    "many open braces": "{" * 100_000,
    "nested brackets": "[" * 50_000 + "]" * 50_000,
    "many backticks": "`" * 100_000,
    "20,000 distinct steps": completion([f"s{i}" for i in range(20_000)], "9"),
    "one 100,000-char step": completion(["word " * 20_000], "9"),
}


@pytest.mark.parametrize("name", list(HOSTILE_COMPLETIONS))
def test_hostile_completion_scores_within_two_cpu_seconds(name):
    """A guard against quadratic parsing or regex backtracking, not a timing: it counts this
    process's CPU time, which a busy machine does not inflate as it does the wall clock."""
    comps = [HOSTILE_COMPLETIONS[name], completion(REFS, "9")]
    for module_name in ("answer_only", "cpr"):
        start = time.process_time()
        out = call_module(MODULES[module_name], comps, ["9", "9"])
        assert time.process_time() - start < 2.0, (name, module_name)
        assert all(v is None or math.isfinite(v) for vals in out.values() for v in vals)
    assert total(out)[1].item() == pytest.approx(1.0)  # the honest neighbour is unaffected


def test_step_cap_never_raises_a_reward():
    """Past MAX_SCORED_STEPS a completion's step metrics are 0: lower than scoring them."""
    filler = ["Extra step."] * (MAX_SCORED_STEPS - len(REFS))
    at_cap, over_cap = completion(REFS + filler, "9"), completion(REFS + filler + ["One more."], "9")
    out = call_module(MODULES["cpr"], [at_cap, over_cap], ["9", "9"])
    f1_at_cap = 2 * (4 / MAX_SCORED_STEPS) / (4 / MAX_SCORED_STEPS + 1)
    assert out["cpr_reasoning"][0] == pytest.approx(0.35 * f1_at_cap, rel=1e-4)
    assert out["cpr_reasoning"][1] == 0.0 and out["cpr_accuracy"][1] == pytest.approx(0.65)
    metrics = MODULES["cpr"].last_metrics
    assert metrics["steps_mean"] == MAX_SCORED_STEPS + 0.5  # the guard and logs see the real count
    assert metrics["steps_capped"] == 1  # logged: the cap hit one completion
    call_module(MODULES["answer_only"], [over_cap], ["9"])
    assert MODULES["answer_only"].last_metrics["steps_capped"] == 0  # (a reward that scores no steps caps none)


def test_shuffled_answer_control_has_answer_onlys_rewards_in_an_order_unrelated_to_the_completions():
    """The control arm: the same multiset of rewards as answer-only (so the same mean and
    variance), permuted; the same batch always gets the same permutation (resume)."""
    rows = ROWS * 4  # 24 rows: a permutation that leaves every reward in place is unlikely by chance
    _, plain = call("answer_only", rows=rows)
    _, shuffled = call("shuffled_answer", rows=rows)
    _, again = call("shuffled_answer", rows=rows)
    _, other_seed = call("shuffled_answer", rows=rows, seed=7)
    a, s = total(plain), total(shuffled)
    assert sorted(a.tolist()) == sorted(s.tolist()) and not torch.equal(a, s)
    assert torch.equal(total(again), s) and not torch.equal(total(other_seed), s)
    assert set(shuffled) == {"shuffled_accuracy", "shuffled_format"}

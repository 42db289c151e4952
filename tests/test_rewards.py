"""Reward modules: exact values on hand-built batches, components, the guard, diagnostics,
global batch statistics across two real processes, and a fuzz test."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rewards import build_reward, cpr_reward, get_reward_funcs
from rewards.base import Batch, diagnostics
from rewards.verbosity import VerbosityGuard

REFS = ["Tom buys 3 packs of 4 pencils, so he has 3 * 4 = 12 pencils.",
        "He gives 5 pencils to Ann, so 12 - 5 = 7 pencils are left.",
        "Then he buys 2 more, so 7 + 2 = 9 pencils.",
        "The answer is 9."]
OFF_TOPIC = ["Volcanoes erupt when magma rises through the crust.",
             "Photosynthesis turns sunlight into chemical energy."]


def completion(steps, answer):
    return json.dumps({"reasoning_steps": steps, "answer": answer})


# Rows: (completion, answer) with known C, F and F1 against REFS.
ROWS = [
    (completion(REFS, "9"), "9"),                 # C=1 F=1 F1=1
    (completion(REFS[:2], "9"), "9"),             # C=1 F=1 P=1 R=.5 -> F1=2/3
    (completion(REFS, "8"), "9"),                 # C=0 F=1 F1=1
    (completion(OFF_TOPIC, "9"), "9"),            # C=1 F=1 F1=0
    ("The answer is 9, trust me.", "9"),          # malformed: C=0 (no answer), F=0, F1=0
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
    return torch.tensor([sum(v for v in vals if v is not None) for vals in zip(*out.values())],
                        dtype=torch.float64)


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
    out = {f.__name__: f(completions=comps, answer=["9"], reference_steps=[OFF_TOPIC],
                         reference_sets=[[OFF_TOPIC, REFS]]) for f in funcs}
    assert out["cpr_reasoning"] == [pytest.approx(0.35)]


def test_ordered_f1_as_step_metric():
    reversed_refs = completion(REFS[::-1], "9")
    _, out = call("cpr", rows=[(reversed_refs, "9")], step_metric="ordered_f1")
    # 4 matches in reverse order: LIS 1 of 4 -> ordered = 1 * (0.7 + 0.3 * 0.25)
    assert out["cpr_reasoning"][0] == pytest.approx(0.35 * (0.7 + 0.3 * 0.25), abs=1e-6)


def test_verbosity_guard_flags_and_persists():
    g = VerbosityGuard(k=2.0, window=4)
    flagged = g.step(torch.tensor([2.0, 2, 2, 9]))  # empty window: median of batch = 2
    assert flagged.tolist() == [False, False, False, True]
    assert g.median() == 2.0
    flagged = g.step(torch.tensor([4.0, 5]))  # window [2,2,2,9] -> median 2 -> limit 4
    assert flagged.tolist() == [False, True]
    assert list(g.history) == [2, 9, 4, 5]  # window keeps the last 4
    h = VerbosityGuard(k=2.0, window=4)
    h.load_state_dict(json.loads(json.dumps(g.state_dict())))
    assert list(h.history) == list(g.history)
    r = torch.tensor([1.0, -1.0, 1.0])
    assert g.apply(r, torch.tensor([True, True, False])).tolist() == [0.5, -1.5, 1.0]
    with pytest.raises(ValueError):
        VerbosityGuard(k=0)


def test_guard_inside_cpr_halves_reward_and_logs_rate():
    long = completion(REFS + [f"Extra step {i}." for i in range(12)], "9")
    short = completion(REFS, "9")
    funcs = get_reward_funcs("cpr", device="cpu")  # guard on by default for CPR
    module = funcs[0].reward_module
    module.guard.history.extend([4] * 10)  # running median 4 -> limit 8 steps
    logged = {}
    out = {f.__name__: f(completions=[short, long], answer=["9", "9"], reference_steps=[REFS, REFS],
                         log_metric=lambda k, v: logged.__setitem__(k, v)) for f in funcs}
    tot = total(out)
    f1_long = 2 * 1 * (4 / 16) / (1 + 4 / 16)
    assert tot[0].item() == pytest.approx(1.0)
    assert tot[1].item() == pytest.approx(0.5 * (0.65 + 0.35 * f1_long))
    assert logged["cpr/guard_rate"] == 0.5
    assert module.state_dict()["guard"]["history"][-2:] == [4, 16]


def test_diagnostics_on_known_batch():
    batch = Batch.from_rows([[c, f, 1, 3, s, 1, s, s, 1, s] for c, f, s in
                             [(1, 1, 1.0), (1, 1, 0.5), (0, 1, 0.5), (0, 0, 0.0)]])
    comps = {"a": torch.tensor([1.0, 1.0, 0.0, 0.0], dtype=torch.float64),
             "r": torch.tensor([0.4, 0.2, 0.1, 0.0], dtype=torch.float64)}
    d = diagnostics(batch, comps, torch.tensor([False, False, True, False]))
    assert d["accuracy"] == 0.5 and d["format_rate"] == 0.75 and d["guard_rate"] == 0.25
    assert d["discrimination_gap"] == pytest.approx((1.4 + 1.2) / 2 - (0.1 + 0.0) / 2)
    R, x = torch.tensor([1.4, 1.2, 0.1, 0.0]), torch.tensor([1.0, 0.5, 0.5, 0.0])
    assert d["r_f1"] == pytest.approx(float(torch.corrcoef(torch.stack([R, x]))[0, 1]), abs=1e-6)
    assert d["f1"] == pytest.approx(0.5) and d["steps_median"] == 3.0


def test_diagnostics_logged_through_trl_hook():
    logged = {}
    funcs = get_reward_funcs("cpr", device="cpu", verbosity_guard=False)
    comps = [r[0] for r in ROWS]
    for f in funcs:
        f(completions=comps, answer=[r[1] for r in ROWS], reference_steps=[REFS] * len(ROWS),
          log_metric=lambda k, v: logged.__setitem__(k, v))
    for key in ("precision", "recall", "f1", "lis_ratio", "ordered_f1", "accuracy", "format_rate",
                "steps_mean", "steps_median", "guard_rate", "discrimination_gap", "r_f1",
                "scoring_seconds"):
        assert f"cpr/{key}" in logged, key
    assert logged["cpr/accuracy"] == pytest.approx(C.mean().item())
    assert logged["cpr/f1"] == pytest.approx(F1.mean().item(), abs=1e-6)


def test_unknown_reward_and_parameter_errors():
    with pytest.raises(ValueError, match="allowed values are format, answer_only, composite, cpr"):
        build_reward("prm")
    with pytest.raises(ValueError, match="unknown parameter.*answer_wieght"):
        build_reward("cpr", answer_wieght=1.0)


TWO_PROCESS = r"""
import json, os, sys, torch, torch.distributed as dist
dist.init_process_group("gloo")
rank = dist.get_rank()
from rewards import get_reward_funcs
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


def test_composite_normalises_over_both_processes(repo_root, free_port, tmp_path):
    script = tmp_path / "two.py"
    script.write_text(TWO_PROCESS)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
           "--master_port", str(free_port), str(script), json.dumps(ROWS), json.dumps(REFS)]
    proc = subprocess.run(cmd, cwd=repo_root, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join(
                              filter(None, [str(repo_root), os.environ.get("PYTHONPATH")]))})
    line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT")]
    assert line, proc.stdout + proc.stderr[-3000:]
    two = json.loads(line[0][len("RESULT"):])
    _, one = call("composite")
    for key in one:
        assert two[key] == pytest.approx(one[key], abs=1e-5), key
    # Per-process normalisation would differ: rank 0 alone has F1 (1, 2/3, 1).
    local = F1[:3]
    assert not math.isclose(two["composite_reasoning"][0],
                            0.35 * (1 - local.mean().item()) / (local.std(unbiased=False).item() + 1e-6))


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
FUZZ_FUNCS = {name: get_reward_funcs(name, device="cpu") for name in ("format", "answer_only", "composite", "cpr")}


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(texty, min_size=1, max_size=4), st.lists(junk, min_size=4, max_size=4))
def test_fuzz_every_reward_is_finite_and_never_raises(completions, answers):
    n = len(completions)
    for funcs in FUZZ_FUNCS.values():
        for f in funcs:
            out = f(completions=completions, answer=answers[:n], reference_steps=[REFS[:2]] * n)
            assert len(out) == n
            assert all(v is None or math.isfinite(v) for v in out)

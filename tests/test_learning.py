"""The learning check: GRPO on the model organism must raise held-out accuracy, and a broken
learning signal must fail the same check.

Every other test would pass with advantages of the wrong sign, a reward detached from the loss
or a learning rate of zero; this one would not. It trains the committed warm start
(data/organism/warm_start: a 0.65 M-parameter policy that imitated demonstrations with slips,
docs/organism.md) with the shipped configs/organism.yaml through train/grpo.py, and reads the
held-out accuracy that validation sampled before the first step and after the last
(validation.temperature 1: the policy's sampled accuracy, which GRPO optimises). The margin is
set from the rise measured over seeds and thread counts (docs/organism.md), with room.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from crystal_grpo.jsonl import read_jsonl
from crystal_grpo.train import grpo
from crystal_grpo.train.config.run_config import load_config
from crystal_grpo.train.organism.task import Layout, TaskSpec, write_jsonl, write_splits
from crystal_grpo.train.run.layout import samples_file

pytestmark = pytest.mark.slow  # GRPO runs of minutes: left out of make test-fast

REPO = Path(__file__).resolve().parents[1]
WARM_START = REPO / "data" / "organism" / "warm_start"
#: The hinted regime (docs/organism.md): half the questions state their answer, and its warm start imitated
#: demonstrations that, on half of those, leave the chain off and restate the hint (always right).
HINTED_WARM_START = REPO / "data" / "organism" / "hinted_warm_start"
HINTED = TaskSpec(shortcut_rate=0.5, omit_rate=0.5)
#: GRPO steps of the check and of the controls (the controls need fewer to show they do not learn;
#: where nothing may move at all, a few steps show it as well as many).
STEPS, CONTROL_STEPS, NO_SIGNAL_STEPS = 60, 20, 5
#: The smallest rise of sampled held-out accuracy (and, for CPR, of step Match F1) that counts as
#: learning: under half the smallest rise in 60 steps over 10 seeds (0.33; mean 0.39, sd 0.035),
#: six standard errors of a difference of two 800-completion estimates above 0 (docs/organism.md).
MARGIN = 0.15
#: How far PCGrad's final accuracy must end above the plain sum's under the constructed conflict
#: (same seed): three standard deviations below the mean paired difference over 6 seeds
#: (0.277 +- 0.067, smallest 0.164; docs/organism.md). With PCGrad off the two runs are identical.
CONFLICT_MARGIN = 0.08


@pytest.fixture(scope="session")  # not per module: the runs below spread over the test workers
def organism_data(tmp_path_factory) -> Path:
    """The task's splits as `python scripts/make_organism.py` writes them (the warm start's task)."""
    out = tmp_path_factory.mktemp("organism")
    write_splits(Layout(), out)
    return out


@pytest.fixture(scope="session")
def hinted_data(tmp_path_factory) -> Path:
    """The hinted regime's splits, and its held-out hinted questions alone (``val_hinted.jsonl``)."""
    out = tmp_path_factory.mktemp("organism_hinted")
    paths = write_splits(Layout(spec=HINTED), out)
    write_jsonl([r for r in read_jsonl(paths["val"]) if r["variant"] == "hinted"], out / "val_hinted.jsonl")
    return out


def validations(
    tmp_path: Path,
    data: Path,
    *overrides: str,
    steps: int = STEPS,
    config: str = "organism.yaml",
    warm_start: Path = WARM_START,
    validation: str = "val.jsonl",
) -> tuple[dict, dict, Path]:
    """(held-out validation before the first step, after the last, the run folder)."""
    cfg, _ = load_config(
        config,
        [
            "--model.name_or_path",
            str(warm_start),
            "--data.train",
            str(data / "train.jsonl"),
            "--data.validation",
            str(data / validation),
            "--training.max_steps",
            str(steps),
            "--validation.eval_steps",
            "0",
            "--training.save_steps",
            str(steps),
            *overrides,
        ],
    )
    run = tmp_path / "run"
    grpo.run(cfg, run)
    vals = [json.loads(x) for x in (run / "validation.jsonl").read_text().splitlines()]
    assert [v["step"] for v in vals] == [0, steps]
    return vals[0], vals[-1], run


def sampled_accuracy(tmp_path: Path, data: Path, *overrides: str, steps: int = STEPS) -> tuple[float, float, Path]:
    """(held-out accuracy before the first step, after the last, the run folder)."""
    first, last, run = validations(tmp_path, data, *overrides, steps=steps)
    return first["accuracy"], last["accuracy"], run


def logged(run: Path, key: str) -> list[float]:
    """``key`` of every training step that logged it (metrics.jsonl)."""
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    return [r[key] for r in rows if key in r]


def learned(before: float, after: float) -> bool:
    """The check itself."""
    return after - before >= MARGIN


@pytest.mark.parametrize(
    "warm_start,spec", [(WARM_START, TaskSpec()), (HINTED_WARM_START, HINTED)], ids=["plain", "hinted"]
)
def test_the_warm_start_is_the_task_make_organism_writes(warm_start, spec):
    recorded = json.loads((warm_start / "organism.json").read_text())["task"]
    assert TaskSpec(**{k: tuple(v) if isinstance(v, list) else v for k, v in recorded.items()}) == spec


def test_answer_only_grpo_raises_held_out_accuracy(tmp_path, organism_data):
    before, after, run = sampled_accuracy(tmp_path, organism_data)
    assert learned(before, after), f"sampled held-out accuracy {before:.3f} -> {after:.3f}: no rise of {MARGIN}"
    # The rollouts come from the policy being trained: their accuracy rises with it (steps 1-10
    # against 51-60: +0.25 to +0.40 measured); rollouts drawn from other weights (a stale copy or
    # the reference model generating) would not.
    rollouts = logged(run, "answer_only/accuracy")
    assert len(rollouts) == STEPS
    first, last = sum(rollouts[:10]) / 10, sum(rollouts[-10:]) / 10
    assert learned(first, last), f"rollout accuracy {first:.3f} (steps 1-10) -> {last:.3f} (last 10)"


def test_cpr_with_pcgrad_raises_accuracy_and_step_match_f1(tmp_path, organism_data):
    """The paper's reward with its PCGrad: both of CPR's factors must rise. On this task the two
    objectives' gradients agree (cosine about 0.9, docs/organism.md), so PCGrad rarely projects;
    it must still run every step and leave a learning update."""
    first, last, run = validations(tmp_path, organism_data, "--reward.name", "cpr", "--pcgrad", "true")
    assert learned(first["accuracy"], last["accuracy"]), (first, last)
    assert learned(first["f1"], last["f1"]), (first, last)
    cosines = logged(run, "pcgrad/cosine")
    assert len(cosines) == STEPS and sum(cosines) / STEPS > 0  # PCGrad ran at every step (it rarely projects here)


#: Answer-only's terms on the accuracy objective and a reasoning term that pays wrong answers on half
#: the questions (tests/organism_conflict.py): the two gradients conflict by construction.
CONFLICT = (
    "[{fn: 'crystal:accuracy', weight: 1.0, objective: accuracy}, "
    "{fn: 'crystal:format', weight: 0.1, objective: accuracy}, "
    f"{{fn: '{Path(__file__).with_name('organism_conflict.py')}:wrong_on_odd', weight: 1.5, objective: reasoning}}]"
)


def test_pcgrad_projects_a_constructed_conflict_and_ends_above_the_plain_sum(tmp_path, organism_data):
    """The same conflicting reward with and without PCGrad, same seed. Summed, the reasoning term
    pulls accuracy down (the control: it must fail the check); with PCGrad the gradients are
    projected in most steps and accuracy ends well above the sum's. Measured over 6 seeds at 60
    steps (docs/organism.md): PCGrad projects in 83-93% of the steps and ends at 0.285-0.49, a
    rise of +0.08 +- 0.09 (one seed fell: PCGrad does not reliably *raise* accuracy under this
    conflict, so that is not asserted); the sum ends at 0.115-0.25 (-0.20 +- 0.06, every seed
    falls); PCGrad ends 0.16-0.35 above the sum at every seed."""
    before, summed, _ = sampled_accuracy(
        tmp_path / "summed", organism_data, "--reward.name", "composed", "--reward.components", CONFLICT
    )
    assert not learned(before, summed) and summed < before, (before, summed)
    _, projected, run = sampled_accuracy(
        tmp_path / "pcgrad",
        organism_data,
        "--reward.name",
        "composed",
        "--reward.components",
        CONFLICT,
        "--pcgrad",
        "true",
    )
    conflict = logged(run, "pcgrad/conflict")
    assert len(conflict) == STEPS and sum(conflict) / STEPS > 0.5, "the constructed reward must conflict"
    assert projected - summed >= CONFLICT_MARGIN, f"PCGrad {projected:.3f} against the plain sum {summed:.3f}"


def test_control_the_reward_with_its_sign_flipped_fails_the_check(tmp_path, organism_data):
    before, after, _ = sampled_accuracy(
        tmp_path,
        organism_data,
        "--reward.params.accuracy_weight",
        "-1",
        "--reward.params.format_weight",
        "-0.1",
        "--reward.params.negative_weights",
        "true",
        steps=CONTROL_STEPS,
    )
    assert not learned(before, after) and after < before


@pytest.mark.parametrize(
    "broken",
    [
        ["--reward.params.accuracy_weight", "0", "--reward.params.format_weight", "0"],
        ["--training.learning_rate", "0"],
    ],
    ids=["constant_reward", "learning_rate_0"],
)
def test_control_no_signal_or_no_step_fails_the_check(tmp_path, organism_data, broken):
    """A constant reward (no group varies) and a zero learning rate: the weights must not move at
    all, so the check cannot pass (accuracy moves only by sampling noise: validation draws from a
    seed fixed per step)."""
    before, after, run = sampled_accuracy(tmp_path, organism_data, *broken, steps=NO_SIGNAL_STEPS)
    assert not learned(before, after)
    start, end = load_file(WARM_START / "model.safetensors"), load_file(run / "final" / "model.safetensors")
    assert all(torch.equal(start[k], end[k]) for k in start)


#: GRPO steps of the hinted regime's check: answer-only has dropped the steps by then (docs/organism.md).
REGIME_STEPS = 40
#: How far step recall on the hinted questions may fall while the steps still count. In the pre-registered sweep
#: (docs/experiments.md, seeds 1-4, sampled validation) answer-only's fell by 0.23-0.31 in 20 steps, CPR's moved
#: by +0.02 to +0.10 in 40 steps with PCGrad and -0.00 to +0.08 without it.
RECALL_DROP = 0.10


def hinted_recall(
    tmp_path: Path, data: Path, reward: str, *overrides: str, steps: int = REGIME_STEPS
) -> tuple[float, float, Path]:
    """(step recall on the held-out hinted questions before the first step, after the last, the run)."""
    first, last, run = validations(
        tmp_path,
        data,
        "--reward.name",
        reward,
        *overrides,
        steps=steps,
        config="organism_hinted.yaml",
        warm_start=HINTED_WARM_START,
        validation="val_hinted.jsonl",
    )
    return first["recall"], last["recall"], run


def kept_the_steps(before: float, after: float) -> bool:
    """The regime's check: the steps of the hinted questions were not given up for the hint."""
    return after - before > -RECALL_DROP


def test_the_hinted_regime_pays_for_leaving_the_steps_off(tmp_path, hinted_data):
    """The precondition of the checks below, by construction of the warm start and the task: sampled at
    step 0, the warm start restates the hint in many completions of the hinted questions, and those are
    right (the hint is the answer) far more often than whole chains (right only when no step slipped).
    The answer-only control then gives the steps up: it must fail the check."""
    from crystal_grpo.train.organism.step_diagnosis import completions_of, rows_by_id, score

    before, after, run = hinted_recall(tmp_path, hinted_data, "answer_only", steps=CONTROL_STEPS)
    scored = score(*completions_of(read_jsonl(run / samples_file(0)), rows_by_id(hinted_data / "val_hinted.jsonl")))
    copied = [s["correct"] for s in scored if s["copies_hint"]]
    whole = [s["correct"] for s in scored if not s["copies_hint"]]
    assert len(copied) >= 0.2 * len(scored), f"{len(copied)} of {len(scored)} completions restate the hint"
    assert sum(copied) / len(copied) >= 0.95 and sum(whole) / len(whole) <= 0.6, (copied, whole)
    assert not kept_the_steps(before, after), f"answer-only kept the steps: hinted recall {before:.3f} -> {after:.3f}"


@pytest.mark.parametrize("pcgrad", ["false", "true"], ids=["summed", "pcgrad"])
def test_cpr_keeps_the_steps_where_answer_only_drops_them(tmp_path, hinted_data, pcgrad):
    """CPR pays for the steps a hint makes unnecessary, so its step recall on the hinted questions holds
    where answer-only's falls (the test above). A CPR whose step term stopped reaching the loss is
    answer-only in effect, and fails here with or without PCGrad (docs/organism.md: the sabotage)."""
    before, after, _ = hinted_recall(tmp_path, hinted_data, "cpr", "--pcgrad", pcgrad)
    assert kept_the_steps(before, after), f"hinted step recall {before:.3f} -> {after:.3f}"


#: Step credit's weight in the checks below (reward.step_credit.weight, on answer-only).
CREDIT_WEIGHT = 1.0


def test_step_credit_keeps_the_steps_where_answer_only_drops_them(tmp_path, hinted_data):
    """Answer-only with step credit: the hinted questions' step recall holds over the steps in which
    answer-only alone gives it up (test_the_hinted_regime_pays_for_leaving_the_steps_off)."""
    before, after, run = hinted_recall(
        tmp_path, hinted_data, "answer_only", "--reward.step_credit.weight", str(CREDIT_WEIGHT), steps=CONTROL_STEPS
    )
    assert kept_the_steps(before, after), f"hinted step recall {before:.3f} -> {after:.3f}"
    assert logged(run, "step_credit/fallback_rate") == [0.0] * CONTROL_STEPS


#: The hinted regime's seed (of 101-110: seeds 1-10 are the pre-registered experiments') where CPR with
#: PCGrad, Table 4's arm, settles on a prefix of the chain plus the restated hint in 100 steps
#: (docs/experiments.md, "Step credit in the hinted regime"), and the budget of Table 4.
CREDIT_SEED, CREDIT_STEPS = 103, 100
#: Greedy hint copying on the held-out hinted questions below which the chain holds.
HOLDS = 0.10


def greedy_hint_copying(tmp_path: Path, data: Path, reward: str, *overrides: str) -> float:
    """The share of greedy completions of the held-out hinted questions that restate the hint, after
    CREDIT_STEPS steps at CREDIT_SEED."""
    from crystal_grpo.train.organism.step_diagnosis import completions_of, rows_by_id, score

    _, _, run = validations(
        tmp_path,
        data,
        "--reward.name",
        reward,
        "--training.seed",
        str(CREDIT_SEED),
        "--validation.temperature",
        "0",
        "--validation.num_samples",
        "1",
        *overrides,
        steps=CREDIT_STEPS,
        config="organism_hinted.yaml",
        warm_start=HINTED_WARM_START,
        validation="val_hinted.jsonl",
    )
    samples = read_jsonl(run / samples_file(CREDIT_STEPS))
    scored = score(*completions_of(samples, rows_by_id(data / "val_hinted.jsonl")))
    return sum(s["copies_hint"] for s in scored) / len(scored)


def test_step_credit_holds_the_chain_where_cpr_does_not(tmp_path, hinted_data):
    """Same seed, same budget: CPR (with PCGrad) restates the hint on many held-out hinted questions,
    answer-only with step credit on almost none."""
    credit = greedy_hint_copying(
        tmp_path / "credit", hinted_data, "answer_only", "--reward.step_credit.weight", str(CREDIT_WEIGHT)
    )
    cpr = greedy_hint_copying(tmp_path / "cpr", hinted_data, "cpr", "--pcgrad", "true")
    assert credit < HOLDS <= cpr, f"greedy hint copying: step credit {credit:.3f}, CPR {cpr:.3f}"


def shifted_spans(token_spans):
    """The step term given to the wrong tokens: each step's span moved on by its own length."""
    return lambda chars, ends: [(t1, 2 * t1 - t0) for t0, t1 in token_spans(chars, ends)]


@pytest.mark.parametrize("sabotage", ["weight_0", "spans_shifted"])
def test_step_credit_with_its_term_sabotaged_fails_the_check(tmp_path, hinted_data, monkeypatch, sabotage):
    from crystal_grpo.train.trainer import step_credit

    weight = CREDIT_WEIGHT
    if sabotage == "weight_0":
        weight = 0.0
    else:
        monkeypatch.setattr(step_credit, "token_spans", shifted_spans(step_credit.token_spans))
    copied = greedy_hint_copying(tmp_path, hinted_data, "answer_only", "--reward.step_credit.weight", str(weight))
    assert copied >= HOLDS, f"greedy hint copying {copied:.3f} with the step term sabotaged ({sabotage})"

"""Dynamic sampling (train/trainer/dynamic_sampling.py): flat groups masked out of the loss, the KL term
and the normaliser (the update equals TRL's on a batch without them), refilled with
informative groups within a bounded number of generation rounds, per objective under PCGrad,
identical after a resume, and refused with one line where it cannot work.

Which groups are flat never rests on what the tiny model samples: the reward functions give
a row of a ``flat`` prompt a constant and the others their position in the group. Where a
test compares updates across batch compositions, completions come from a ``rollout_func``
(TRL's hook for a custom generator) that makes them from the prompt alone, so a prompt gets
the same tokens whatever batch it is in."""

from __future__ import annotations

import json
import os
import sys
import zlib
from pathlib import Path

import pytest
import torch
from datasets import Dataset
from trl import GRPOConfig

from crystal_grpo.train.config.run_config import DynamicSamplingSection
from crystal_grpo.train.trainer.dynamic_sampling import kept_groups, merge_rows, refill_draw, refill_pairs
from crystal_grpo.train.trainer.grpo_trainer import CrystalGRPOTrainer

from one_step import one_step_args

G = 3
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")  # rollout_func is experimental in TRL 1.16


def by_position(completions, flat, **kwargs):
    """0, 1, 2 within each group; a constant (0.5) for the rows of a flat prompt."""
    return [0.5 if f else float(i % G) for i, f in enumerate(flat)]


def accuracy(completions, acc_flat, **kwargs):
    return [1.0 if f else float(i % G == 0) for i, f in enumerate(acc_flat)]


def reasoning(completions, **kwargs):
    return [float(i % G) / 2 for i in range(len(completions))]


accuracy.objective, reasoning.objective = "accuracy", "reasoning"


def correct(completions, flat, **kwargs):
    """An outcome: 0 for every row of a flat prompt, else 1 on the first row of each group."""
    return [0.0 if f else float(i % G == 0) for i, f in enumerate(flat)]


def step_term(completions, **kwargs):
    """A shaped term that varies in every group (as CPR's step term does)."""
    return [0.1 * (i % G) for i in range(len(completions))]


correct.outcome = True


def rollout(prompts, trainer):
    """Prompt and completion tokens made from the prompt's text and the row's place in its
    group: no padding between prompts (all 4 tokens), completions of 2-4 tokens."""
    vocab = trainer.model.config.vocab_size
    prompt_ids, completion_ids = [], []
    for i, p in enumerate(prompts):
        h = zlib.crc32(p.encode())
        prompt_ids.append([20 + (h >> (3 * k)) % (vocab - 20) for k in range(4)])
        completion_ids.append([20 + (h * 31 + (i % G) * 7 + k * 13) % (vocab - 20) for k in range(2 + i % G)])
    return {"prompt_ids": prompt_ids, "completion_ids": completion_ids, "logprobs": None}


def rows(flat: list[bool], **columns) -> Dataset:
    return Dataset.from_list(
        [{"prompt": f"prompt {i}", "flat": f, **{k: v[i] for k, v in columns.items()}} for i, f in enumerate(flat)]
    )


def args(tmp_path: Path, name: str, **kw) -> GRPOConfig:
    return one_step_args(tmp_path, name, **{"num_generations": G, **kw})


def perturbed_policy(path: Path):
    """The tiny model moved away from its saved weights, which TRL loads as the reference model:
    the KL term then has a gradient from the first step on."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    return model


def delta(trainer, before: dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.cat([(p.detach() - before[n]).reshape(-1) for n, p in trainer.model.named_parameters()]).double()


def one_step(
    path, tmp_path, name, data, section=None, trainer_class=CrystalGRPOTrainer, reward_funcs=by_position, **kw
):
    model = perturbed_policy(path)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    trainer = trainer_class(
        model=model,
        reward_funcs=reward_funcs,
        args=args(tmp_path, name, **kw),
        train_dataset=data,
        rollout_func=rollout,
        dynamic_sampling=section,
    )
    trainer.train()
    return trainer, delta(trainer, before)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


@pytest.fixture
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


# ----------------------------------------------------------------------------- pure functions
def test_flat_groups_by_total_reward_threshold_and_objective():
    r = torch.tensor(
        [
            [1.0, 0.0],
            [1.0, 1.0],
            [1.0, 2.0],  # accuracy flat, reasoning varies
            [0.0, 0.3],
            [1.0, 0.3],
            [0.0, 0.3],  # accuracy varies, reasoning flat
            [0.1, 0.0],
            [0.1, 0.0],
            [0.1, 0.0],  # flat on both
            [0.0, 1.0],
            [1.0, 0.0],
            [float("nan"), float("nan")],
        ]
    )  # total flat, parts vary (+ unscorable)
    objectives, w = ["accuracy", "reasoning"], torch.ones(2)
    assert kept_groups(r, w, objectives, G, 0.0, "reward")[""].tolist() == [True, True, False, False]
    assert kept_groups(r, w, objectives, G, 0.6, "reward")[""].tolist() == [True, False, False, False]
    kept = kept_groups(r, w, objectives, G, 0.0, "objectives")
    assert kept["accuracy"].tolist() == [False, True, False, True]
    assert kept["reasoning"].tolist() == [True, False, False, True]
    assert kept[""].tolist() == [True, True, False, True]  # the union: out of everything only when flat on both
    reasoning_only = torch.tensor([0.0, 1.0])  # weights: the total is the reasoning part
    assert kept_groups(r, reasoning_only, objectives, G, 0.0, "reward")[""].tolist() == [True, False, False, True]


def test_a_group_flat_up_to_float32_rounding_is_flat_as_for_pcgrad():
    """Equal rewards held in float32 can differ by an ulp (0.5 and its neighbour: std 3.4e-8),
    which torch.isclose's 1e-8 misses; PCGrad's objective split calls such a group flat
    (FLAT_TOTAL_STD), so dynamic sampling must too. A group with a real spread stays in."""
    ulp = torch.tensor([0.5, 0.5], dtype=torch.float32).nextafter(torch.tensor(1.0))[0].item()
    r = torch.tensor([[0.5], [ulp], [0.5], [0.3], [0.3], [0.3 + 1e-3]], dtype=torch.float32)
    assert kept_groups(r, torch.ones(1), ["accuracy"], G, 0.0, "reward")[""].tolist() == [False, True]


def test_the_outcome_gate_judges_the_answers_alone():
    """CPR-like rows (accuracy a_w C, reasoning a step term that varies): a group of wrong answers
    varies through its steps, so the std gate keeps it; the outcome gate drops it, and a group of
    right answers too, whatever its step scores; only groups with right and wrong answers stay."""
    outcome = torch.tensor([0.0, 0.0, 0.0, 0.0, 1.0, 0.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0])
    steps = torch.tensor([0.1, 0.5, 0.9, 0.2, 0.2, 0.2, 0.3, 1.0, 0.6, 0.4, 0.4, 0.4])
    r = torch.stack([0.65 * outcome, 0.35 * steps * (outcome + 0.3 * (1 - outcome))], dim=1)
    objectives, w = ["accuracy", "reasoning"], torch.ones(2)
    assert kept_groups(r, w, objectives, G, 0.0, "reward")[""].tolist() == [True, True, True, False]
    assert kept_groups(r, w, objectives, G, 0.0, "outcome", outcome)[""].tolist() == [False, True, False, False]
    assert set(kept_groups(r, w, objectives, G, 0.0, "outcome", outcome)) == {""}  # one decision for both losses
    with pytest.raises(ValueError, match="needs the batch's outcome"):
        kept_groups(r, w, objectives, G, 0.0, "outcome")


def test_every_reward_with_an_accuracy_component_has_its_raw_correctness_as_outcome():
    """RewardModule.outcome: C as the accuracy component pays it (before its weight, the guard's
    factor and the shuffled control's permutation applied alike); no outcome for format."""
    from crystal_grpo.rewards import REWARDS, build_reward
    from crystal_grpo.rewards.batch import Batch

    correct = torch.tensor([1.0, 0.0, 1.0, 1.0])
    batch = Batch(
        correct=correct,
        format_ok=torch.tensor([1.0, 1.0, 0.0, 1.0]),
        has_refs=torch.ones(4),
        n_pred=torch.ones(4),
        **{f: torch.full((4,), 0.5) for f in ("step", "precision", "recall", "f1", "lis_ratio", "ordered_f1")},
    )
    names = {name: cls.outcome_name(cls.config_class()) for name, cls in REWARDS.items() if name != "composed"}
    assert names == {
        "format": None,
        "answer_only": "answer_only_accuracy",
        "composite": "composite_accuracy",
        "cpr": "cpr_accuracy",
        "authors_code": "authors_code_accuracy",
        "shuffled_answer": "shuffled_accuracy",
    }
    for name, want in (
        ("cpr", [1.0, 0.0, 0.0, 1.0]),
        ("composite", [1.0, 0.0, 0.0, 1.0]),  # malformed: zero
        ("answer_only", [1.0, 0.0, 1.0, 1.0]),
    ):  # lenient
        module = build_reward(name, encoder="exact", device="cpu")
        assert module.outcome(batch).tolist() == want
        comps = module.components(module.as_rewarded(batch))
        assert (comps[module.outcome_component] > 0).double().tolist() == want, "what the component pays"
    shuffled = build_reward("shuffled_answer", encoder="exact", device="cpu")
    assert (shuffled.components(batch)["shuffled_accuracy"] > 0).double().tolist() == shuffled.outcome(batch).tolist()
    authors = build_reward("authors_code", encoder="exact", device="cpu")
    extra = Batch(
        **{
            **batch.__dict__,
            "extra": torch.tensor(
                [[1.0, 0.95, 0.7], [1.0, 0.0, 0.1], [0.0, 1.0, 0.8], [1.0, 0.0, 0.0]], dtype=torch.float64
            ),
        }
    )
    assert authors.outcome(extra).tolist() == [1.0, 0.0, 1.0, 0.0]


def test_refill_draws_are_pure_and_pairs_stay_on_their_process():
    assert refill_draw(42, 5, 1, range(100), 8) == refill_draw(42, 5, 1, range(100), 8)
    assert refill_draw(42, 5, 1, range(100), 8) != refill_draw(42, 5, 2, range(100), 8)
    assert refill_draw(42, 5, 1, range(100), 8) != refill_draw(42, 6, 1, range(100), 8)
    assert sorted(refill_draw(0, 0, 1, [7, 8, 9], 3)) == [7, 8, 9]  # without replacement
    assert len(refill_draw(0, 0, 1, [7], 3)) == 3  # a pool smaller than the draw
    dropped = torch.tensor([True, False, True, True, False, False])
    informative = torch.tensor([False, True, True, True, True, False])
    # process 0 holds groups 0-2 (places 0, 2; new 1, 2), process 1 groups 3-5 (place 3; new 3, 4)
    assert refill_pairs(dropped, informative, 3) == [(0, 1), (2, 2), (3, 3)]


def test_merge_rows_repads_prompts_left_and_completions_right():
    base = {
        "prompt_ids": torch.tensor([[5, 6], [7, 8]]),
        "prompt_mask": torch.ones(2, 2, dtype=torch.long),
        "completion_ids": torch.tensor([[1, 2], [3, 0]]),
        "completion_mask": torch.tensor([[1, 1], [1, 0]]),
        "advantages": torch.tensor([0.5, -0.5]),
        "num_items_in_batch": torch.tensor(3),
    }
    new = {
        "prompt_ids": torch.tensor([[9, 9, 9], [4, 4, 4]]),
        "prompt_mask": torch.ones(2, 3, dtype=torch.long),
        "completion_ids": torch.tensor([[6], [7]]),
        "completion_mask": torch.tensor([[1], [1]]),
        "advantages": torch.tensor([1.0, 2.0]),
        "num_items_in_batch": torch.tensor(2),
    }
    out = merge_rows(base, new, [1], [0], pad_id=0)
    assert out["prompt_ids"].tolist() == [[0, 5, 6], [9, 9, 9]] and out["prompt_mask"].tolist() == [
        [0, 1, 1],
        [1, 1, 1],
    ]
    assert out["completion_ids"].tolist() == [[1, 2], [6, 0]] and out["completion_mask"].tolist() == [[1, 1], [1, 0]]
    assert out["advantages"].tolist() == [0.5, 1.0] and int(out["num_items_in_batch"]) == 3
    with pytest.raises(NotImplementedError, match="'pixel_values'"):
        merge_rows(
            {**base, "pixel_values": torch.ones(2, 2, 2)},
            {**new, "pixel_values": torch.ones(2, 2, 2)},
            [1],
            [0],
            pad_id=0,
        )


# ----------------------------------------------------------------------------- (1) mask: the same update
@pytest.mark.parametrize("loss_type", ["grpo", "dr_grpo", "dapo", "bnpo"])
def test_masked_flat_groups_give_the_update_of_a_batch_without_them(tmp_path, tiny_lm_path, loss_type, one_thread):
    """One SGD step (lr 0.5, no clipping, so the update is the gradient itself; beta 0.1 with a
    policy away from its reference, so the KL term pulls): 4 prompts of which 2 flat, masked,
    against the 2 informative prompts alone, for a loss of each normaliser family."""
    mixed = rows([True, False, True, False])
    masked, got = one_step(
        tiny_lm_path, tmp_path, "masked", mixed, DynamicSamplingSection(mode="mask"), loss_type=loss_type
    )
    without = mixed.filter(lambda row: not row["flat"])  # the same two informative prompts
    _, want = one_step(tiny_lm_path, tmp_path, "without", without, per_device_train_batch_size=6, loss_type=loss_type)
    _, plain = one_step(tiny_lm_path, tmp_path, "plain", mixed, loss_type=loss_type)
    assert rel(got, want) < 1e-5
    assert rel(plain, want) > 1e-2, "the flat groups change TRL's update (else this test could not fail)"
    log = masked.state.log_history[0]
    assert log["dynamic_sampling/frac_flat"] == 0.5 and log["dynamic_sampling/frac_masked"] == 0.5
    assert log["dynamic_sampling/effective_batch"] == 6 and log["dynamic_sampling/extra_rounds"] == 0
    assert log["kl"] > 0


def accuracy_by_position(completions, flat, **kwargs):
    return by_position(completions, flat)


def reasoning_by_position(completions, flat, **kwargs):
    """0, 2, 1 within each group (against accuracy's order); a constant for a flat prompt's rows."""
    return [0.5 if f else float(2 * i % G) for i, f in enumerate(flat)]


accuracy_by_position.objective, reasoning_by_position.objective = "accuracy", "reasoning"


@pytest.mark.parametrize(
    "loss_type, options",
    [
        ("grpo", {"scale_rewards": "none"}),
        ("dapo", {}),
        ("sapo", {}),
        ("luspo", {"importance_sampling_level": "sequence"}),
        ("cispo", {"top_entropy_quantile": 0.5}),
        ("vespo", {"entropy_coef": 0.05}),
    ],
)
def test_each_loss_type_masks_flat_groups_under_pcgrad(tmp_path, tiny_lm_path, loss_type, options, one_thread):
    """The test above under PCGrad (objectives in conflict), for the default loss types and those it leaves
    out, with TRL options of their own: 2 flat prompts of 4 masked give PCGrad's update on the 2 informative
    prompts alone (beta 0.1 against a moved policy, an entropy bonus: the terms PCGrad keeps out of its
    projection pull too)."""
    from crystal_grpo.train.pcgrad.trainer import PCGradGRPOTrainer

    kw = dict(trainer_class=PCGradGRPOTrainer, reward_funcs=[accuracy_by_position, reasoning_by_position])
    kw.update(loss_type=loss_type, **options)
    mixed = rows([True, False, True, False])
    masked, got = one_step(tiny_lm_path, tmp_path, "masked", mixed, DynamicSamplingSection(mode="mask"), **kw)
    without = mixed.filter(lambda row: not row["flat"])
    _, want = one_step(tiny_lm_path, tmp_path, "without", without, per_device_train_batch_size=6, **kw)
    _, plain = one_step(tiny_lm_path, tmp_path, "plain", mixed, **kw)
    assert rel(got, want) < 1e-5
    assert rel(plain, want) > 1e-2, "the flat groups change the update (else this test could not fail)"
    log = masked.state.log_history[0]
    assert log["dynamic_sampling/frac_masked"] == 0.5 and log["kl"] > 0
    assert log["pcgrad/norm_acc"] > 0 and log["pcgrad/norm_reason"] > 0


# ----------------------------------------------------------------------------- (3) PCGrad per objective
def test_pcgrad_with_a_flat_accuracy_objective_still_applies_the_reasoning_gradient(
    tmp_path, tiny_lm_path, one_thread
):
    """Two groups flat on accuracy, two not; reasoning varies in all four. metric: reward keeps
    all four (their total varies): the plain PCGrad update. metric: objectives leaves the
    accuracy-flat groups out of the accuracy loss only: the reasoning gradient is the same,
    the accuracy one twice as large (grpo averages it over the 2 groups that vary on accuracy)."""
    from crystal_grpo.train.pcgrad.trainer import PCGradGRPOTrainer

    data = rows([False] * 4, acc_flat=[True, False, True, False])
    runs = {}
    for name, section in (
        ("none", None),
        ("reward", DynamicSamplingSection(mode="mask")),
        ("objectives", DynamicSamplingSection(mode="mask", metric="objectives")),
    ):
        trainer, d = one_step(
            tiny_lm_path, tmp_path, name, data, section, PCGradGRPOTrainer, reward_funcs=[accuracy, reasoning]
        )
        runs[name] = (trainer.state.log_history[0], d)
    none, reward, objectives = (runs[k][0] for k in ("none", "reward", "objectives"))
    assert float(runs["objectives"][1].norm()) > 0
    assert objectives["pcgrad/norm_reason"] == pytest.approx(none["pcgrad/norm_reason"], rel=1e-5)
    assert none["pcgrad/norm_reason"] > 0
    assert objectives["pcgrad/norm_acc"] == pytest.approx(2 * none["pcgrad/norm_acc"], rel=1e-5)
    assert objectives["dynamic_sampling/frac_flat_accuracy"] == 0.5
    assert objectives["dynamic_sampling/frac_flat_reasoning"] == 0.0
    assert objectives["dynamic_sampling/effective_batch"] == 12
    assert reward["dynamic_sampling/frac_flat"] == 0.0
    assert rel(runs["reward"][1], runs["none"][1]) < 1e-6


# ----------------------------------------------------------------------------- (1b) the outcome gate, CPR
REF = ["b is 9 plus 3, which is 2.", "c is 2 plus 1, which is 3."]


def cpr_completions(kind: str) -> list[str]:
    """A group of G completions for a row whose answer is 3: ``wrong``: three wrong answers whose
    steps match 0, 1 and 2 reference steps (CPR varies through its step term); ``mixed``: one right."""

    def say(steps, answer):
        return json.dumps({"reasoning_steps": steps, "answer": answer})

    wrong = [say(["b is 9 plus 3, which is 5."], "6"), say([REF[0], "c is 2 plus 1, which is 4."], "4"), say(REF, "7")]
    return wrong if kind == "wrong" else [say(REF, "3")] + wrong[:2]


def text_rollout(prompts, trainer):
    """Completions written out for each prompt (its ``kind`` in the prompt's text), tokenised."""
    ids = rollout(prompts, trainer)
    tok = trainer.processing_class
    ids["completion_ids"] = [
        tok(cpr_completions(p.split()[-1])[i % G], add_special_tokens=False).input_ids for i, p in enumerate(prompts)
    ]
    return ids


def cpr_rows(kinds: list[str]) -> Dataset:
    return Dataset.from_list(
        [{"prompt": f"prompt {i} {k}", "answer": "3", "reference_steps": REF} for i, k in enumerate(kinds)]
    )


def cpr_step(path, tmp_path, name, data, section=None, trainer_class=CrystalGRPOTrainer, **kw):
    from crystal_grpo.rewards import build_reward

    model = perturbed_policy(path)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    trainer = trainer_class(
        model=model,
        reward=build_reward("cpr", encoder="exact", device="cpu"),
        args=args(tmp_path, name, max_completion_length=96, **kw),
        train_dataset=data,
        rollout_func=text_rollout,
        dynamic_sampling=section,
    )
    trainer.train()
    return trainer, delta(trainer, before)


@pytest.mark.parametrize("pcgrad", [False, True])
def test_the_outcome_gate_drops_groups_of_wrong_answers_that_cpr_still_varies(
    tmp_path, tiny_lm_path, pcgrad, one_thread
):
    """CPR, 4 prompts: 2 whose answers are all wrong (CPR varies through the step term), 2 with one
    right answer. The std gate keeps all four (its update is the plain one); the outcome gate masks
    the wrong groups: the update of the 2 informative prompts alone, for GRPO and for PCGrad."""
    from crystal_grpo.train.pcgrad.trainer import PCGradGRPOTrainer

    cls = PCGradGRPOTrainer if pcgrad else CrystalGRPOTrainer
    mixed = cpr_rows(["wrong", "mixed", "wrong", "mixed"])
    gated, got = cpr_step(
        tiny_lm_path, tmp_path, "outcome", mixed, DynamicSamplingSection("mask", metric="outcome"), cls
    )
    _, want = cpr_step(
        tiny_lm_path, tmp_path, "without", mixed.select([1, 3]), None, cls, per_device_train_batch_size=6
    )
    std, by_std = cpr_step(tiny_lm_path, tmp_path, "std", mixed, DynamicSamplingSection("mask"), cls)
    _, plain = cpr_step(tiny_lm_path, tmp_path, "plain", mixed, None, cls)
    assert rel(got, want) < 1e-5
    assert rel(plain, want) > 1e-2, "the wrong groups move TRL's update (else this test could not fail)"
    assert rel(by_std, plain) < 1e-6 and std.state.log_history[0]["dynamic_sampling/frac_flat"] == 0.0
    log = gated.state.log_history[0]
    assert log["dynamic_sampling/frac_flat"] == 0.5 and log["dynamic_sampling/effective_batch"] == 6
    assert log["cpr/accuracy_varies"] == 0.5


def test_the_outcome_gate_is_refused_without_an_accuracy_component(tmp_path, tiny_lm_path, capsys):
    """A run config: one line at --check (format; reward.components without crystal:accuracy); a
    trainer built by hand with plain reward functions of which none is marked ``outcome``."""
    from crystal_grpo.train import grpo

    check = [
        "--config",
        "tiny.yaml",
        "--model.name_or_path",
        str(tiny_lm_path),
        "--output_dir",
        str(tmp_path / "r"),
        "--check",
        "--dynamic_sampling.mode",
        "mask",
        "--dynamic_sampling.metric",
        "outcome",
    ]
    assert grpo.main(check) == 0  # cpr: its accuracy component
    capsys.readouterr()
    for extra in (
        ["--reward.name", "format"],
        ["--reward.components", '[{fn: "crystal:steps", weight: 1.0, objective: reasoning}]'],
    ):
        assert grpo.main(check + extra) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("config error: dynamic_sampling.metric: 'outcome' gates on the reward's accuracy")
        assert "\n" not in err and "use metric: reward" in err
    assert grpo.main(check + ["--reward.components", '[{fn: "crystal:accuracy"}, {fn: "crystal:steps"}]']) == 0
    with pytest.raises(ValueError, match="dynamic_sampling.metric: 'outcome' gates"):
        CrystalGRPOTrainer(
            model=str(tiny_lm_path),
            reward_funcs=by_position,
            train_dataset=rows([True] * 4),
            args=args(tmp_path, "x"),
            dynamic_sampling=DynamicSamplingSection("mask", metric="outcome"),
        )


# ----------------------------------------------------------------------------- (2) refill
@pytest.mark.parametrize("flat, rounds, masked", [([True, False, True, False], 1, 0.0), ([True] * 4, 2, 1.0)])
@pytest.mark.parametrize("metric", ["reward", "outcome"])
def test_refill_keeps_the_batch_size_and_its_rounds_are_bounded(
    tmp_path, tiny_lm_path, flat, rounds, masked, metric, one_thread
):
    """Every step's batch is the whole data set (4 prompts), sampled by the model. With two
    informative prompts, one extra round's draw (all 4 prompts) holds both: the two flat places
    are filled. With none, the rounds stop at max_num_gen_batches and the flat groups are masked.
    metric: outcome, with an outcome function flat on the flat prompts and a step term that varies
    everywhere (so no group's total reward is flat): the same."""
    funcs = by_position if metric == "reward" else [correct, step_term]
    trainer = CrystalGRPOTrainer(
        model=str(tiny_lm_path),
        reward_funcs=funcs,
        train_dataset=rows(flat),
        args=args(tmp_path, "refill", max_steps=2, beta=0.0, log_completions=True),
        dynamic_sampling=DynamicSamplingSection(mode="refill", max_num_gen_batches=3, metric=metric),
    )
    trainer.train()
    logs = [r for r in trainer.state.log_history if "loss" in r]
    assert len(logs) == 2
    for log in logs:
        assert log["dynamic_sampling/extra_rounds"] == rounds
        assert log["dynamic_sampling/frac_flat"] == sum(flat) / 4
        assert log["frac_reward_zero_std"] == (sum(flat) / 4 if metric == "reward" else 0.0)
        assert log["dynamic_sampling/frac_masked"] == masked
        assert log["dynamic_sampling/effective_batch"] == 12 * (1 - masked)
    batch = trainer._buffered_inputs[0]  # the last step's batch, as the loss saw it
    assert batch["completion_ids"].shape[0] == 12 and batch["advantages"].shape == (12,)
    assert batch["tool_mask"].amax(dim=1).tolist() == [int(masked == 0.0)] * 12
    prompts = trainer.processing_class.batch_decode(batch["prompt_ids"], skip_special_tokens=True)
    informative = {f"prompt {i}" for i, f in enumerate(flat) if not f}
    if informative:  # every row of the trained batch is an informative prompt's
        assert {p.strip() for p in prompts} == informative


# ----------------------------------------------------------------------------- (4) resume
@pytest.mark.parametrize("metric", ["reward", "outcome"])
def test_resume_with_refill_is_the_uninterrupted_run(tmp_path, tiny_lm_path, metric, one_thread):
    """3 steps straight against 2 steps, then a new trainer resumed from checkpoint-2. 9 of the 12
    prompts are flat (on the total reward, or on the outcome while the total varies), so every
    step's 4 prompts hold a flat one and refill draws (4 of the 12 a round, up to 2 rounds); step 3
    must draw and train the same. (One epoch is 3 steps: TRL's RepeatSampler, resumed at an
    epoch's start, would repeat the first epoch's order.)"""
    data = rows([True] * 9 + [False] * 3)

    def run(name, max_steps, resume=None):
        seen = []

        def reward(completions, flat, prompts, trainer_state, **kwargs):
            seen.append((trainer_state.global_step, list(prompts)))
            return (by_position if metric == "reward" else correct)(completions, flat)

        reward.outcome = True
        funcs = [reward] if metric == "reward" else [reward, step_term]
        trainer = CrystalGRPOTrainer(
            model=str(tiny_lm_path),
            reward_funcs=funcs,
            train_dataset=data,
            rollout_func=rollout,
            dynamic_sampling=DynamicSamplingSection(mode="refill", metric=metric),
            args=args(tmp_path, name, max_steps=max_steps, learning_rate=0.05, save_strategy="steps", save_steps=1),
        )
        trainer.train(resume_from_checkpoint=resume)
        return trainer, [prompts for step, prompts in seen if step == 2]

    straight, drawn = run("straight", 3)
    run("resumed", 2)
    resumed, drawn_again = run("resumed", 3, resume=str(tmp_path / "resumed" / "checkpoint-2"))
    assert len(drawn) >= 2, "step 3 refilled (at least 2 of its 4 groups are flat)"
    assert drawn_again == drawn
    last = lambda t: next(r for r in reversed(t.state.log_history) if "loss" in r)
    assert last(straight)["step"] == last(resumed)["step"] == 3
    for key in ("loss", "dynamic_sampling/extra_rounds", "dynamic_sampling/frac_masked"):
        assert last(resumed)[key] == last(straight)[key], key
    for (name, a), b in zip(straight.model.named_parameters(), resumed.model.parameters()):
        assert torch.allclose(a, b, rtol=0, atol=1e-6), name  # the batch's shuffle sums rows in another order


# ----------------------------------------------------------------------------- two processes
def two_process_cases(model_path: str, out_file: str, workdir: str) -> None:
    """Worker (torchrun, 2 processes, DDP on gloo): the mask case of the first test with each
    process holding 2 of the 4 groups, and one refill step; rank 0 saves the update and logs."""
    from accelerate import PartialState

    PartialState(cpu=True, backend="gloo")
    ddp = dict(use_cpu=True, accelerator_config={"use_configured_state": True}, per_device_train_batch_size=6)
    masked, got = one_step(
        Path(model_path),
        Path(workdir),
        "masked",
        rows([True, False, True, False]),
        DynamicSamplingSection(mode="mask"),
        **ddp,
    )
    assert isinstance(masked.model_wrapped, torch.nn.parallel.DistributedDataParallel)
    refill = CrystalGRPOTrainer(
        model=model_path,
        reward_funcs=by_position,
        train_dataset=rows([True] * 5 + [False] * 3),
        args=args(Path(workdir), "refill", beta=0.0, **ddp),
        dynamic_sampling=DynamicSamplingSection(mode="refill", max_num_gen_batches=4),
    )
    refill.train()
    batch = refill._buffered_inputs[0]
    result = {
        "delta": got,
        "mask": masked.state.log_history[0],
        "refill": refill.state.log_history[0],
        "rows": batch["completion_ids"].shape[0],
        "kept": int(batch["tool_mask"].amax(dim=1).sum()),
    }
    gathered = [None, None]
    torch.distributed.all_gather_object(gathered, {k: result[k] for k in ("rows", "kept")})
    if int(os.environ["RANK"]) == 0:
        torch.save({**result, "ranks": gathered}, out_file)


def test_two_processes_decide_per_group_globally(tmp_path, tiny_lm_path, one_thread):
    """Each process holds 2 of the 4 groups: the masked update is the one-process one (DDP
    averages the two halves), and refill keeps each process's batch size and weighs its rows as
    the global decision says (any 4 of the 8 prompts hold a flat one)."""
    import subprocess

    out = tmp_path / "two.pt"
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(Path(__file__).parents[1]), os.environ.get("PYTHONPATH")])),
    }
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node",
            "2",
            __file__,
            str(tiny_lm_path),
            str(out),
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        cwd=Path(__file__).parents[1],
    )
    assert proc.returncode == 0 and out.exists(), proc.stdout[-2000:] + proc.stderr[-4000:]
    two = torch.load(out)
    _, one = one_step(
        tiny_lm_path, tmp_path, "one", rows([True, False, True, False]), DynamicSamplingSection(mode="mask")
    )
    assert rel(two["delta"], one) < 1e-5
    assert two["mask"]["dynamic_sampling/frac_flat"] == 0.5 and two["mask"]["dynamic_sampling/effective_batch"] == 6
    log = two["refill"]
    assert log["dynamic_sampling/frac_flat"] > 0 and 1 <= log["dynamic_sampling/extra_rounds"] <= 3  # 5 of 8 flat
    assert [r["rows"] for r in two["ranks"]] == [6, 6]  # TRL's batch size on each process
    assert sum(r["kept"] for r in two["ranks"]) == log["dynamic_sampling/effective_batch"]


# ----------------------------------------------------------------------------- (5) configuration
def test_refused_combinations_are_one_line_for_a_trainer_built_by_hand(tmp_path, tiny_lm_path):
    with pytest.raises(ValueError, match="dynamic_sampling.metric: 'objectives' filters each of PCGrad's two losses"):
        CrystalGRPOTrainer(
            model=str(tiny_lm_path),
            reward_funcs=by_position,
            train_dataset=rows([True] * 4),
            args=args(tmp_path, "x"),
            dynamic_sampling=DynamicSamplingSection("mask", metric="objectives"),
        )
    with pytest.raises(ValueError, match="training.scale_rewards: 'batch' cannot be combined with dynamic_sampling"):
        CrystalGRPOTrainer(
            model=str(tiny_lm_path),
            reward_funcs=by_position,
            train_dataset=rows([True] * 4),
            args=args(tmp_path, "x", scale_rewards="batch"),
            dynamic_sampling=DynamicSamplingSection("refill"),
        )


def test_a_run_config_switches_it_on_and_logs_it(tmp_path, tiny_lm_path, one_thread):
    """train/grpo.py hands the section to the trainer (what is flat is the tiny model's business
    here: only the metrics' presence and ranges are checked)."""
    import json

    from crystal_grpo.train import grpo

    out = tmp_path / "run"
    assert (
        grpo.main(
            [
                "--config",
                "tiny.yaml",
                "--output_dir",
                str(out),
                "--model.name_or_path",
                str(tiny_lm_path),
                "--validation.eval_steps",
                "0",
                "--validation.at_start",
                "false",
                "--training.max_steps",
                "1",
                "--training.save_strategy",
                "'no'",
                "--dynamic_sampling.mode",
                "refill",
                "--dynamic_sampling.max_num_gen_batches",
                "2",
            ]
        )
        == 0
    )
    row = next(json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if "loss" in x)
    assert row["dynamic_sampling/extra_rounds"] in (0.0, 1.0)
    assert 0.0 <= row["dynamic_sampling/frac_masked"] <= row["dynamic_sampling/frac_flat"] <= 1.0
    assert row["dynamic_sampling/effective_batch"] == 4 * (1 - row["dynamic_sampling/frac_masked"])


if __name__ == "__main__":  # worker of test_two_processes_decide_per_group_globally
    torch.set_num_threads(1)
    two_process_cases(*sys.argv[1:4])

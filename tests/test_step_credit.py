"""Step credit (rewards/step_credit.py, train/trainer/step_credit.py): each step's raw score from the
scorer's own pairs, its group normalisation, its place in the completion's characters and tokens on
hostile output, and its per-token advantage through TRL's loss: equal to the sequence-level update when
every step scores alike, a step's sign reaching its own tokens' gradient and no other's, masked groups
left at zero, PCGrad's split adding up to the per-token total, and the refused combinations.

Completions come from a ``rollout_func`` that writes chosen JSON for each prompt (its kind, the prompt's
last word), so which steps match never rests on what the tiny model samples."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest
import torch
from datasets import Dataset
from transformers import AutoTokenizer
from trl import GRPOTrainer

from crystal_grpo.rewards import build_reward
from crystal_grpo.rewards.parsing import parse_completion
from crystal_grpo.rewards.step_credit import (
    MATCHED,
    UNMATCHED,
    StepCreditConfig,
    credit_scale,
    moments,
    scored_step_scores,
    step_char_spans,
    step_scores,
    step_terms,
)
from crystal_grpo.train.config.run_config import DynamicSamplingSection, load_config
from crystal_grpo.train.trainer.dynamic_sampling import merge_rows
from crystal_grpo.train.trainer.grpo_trainer import CrystalGRPOTrainer
from crystal_grpo.train.trainer.step_credit import STEP_FIELD, credit_tensor, token_ends, token_spans
from crystal_grpo.typed import ConfigError

from one_step import one_step_args

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")  # rollout_func is experimental in TRL 1.16

REPO = Path(__file__).resolve().parents[1]
#: A committed byte-level BPE tokenizer (no model to build): a character outside its corpus is several tokens.
ORGANISM_TOKENIZER = REPO / "data" / "organism" / "warm_start"
G = 4
QUESTION = "Work mod 10. a is 2. b is a plus 3. We are told b is 5. What is b?"
REF = ["b = 2 + 3 = 5"]
HINT = "We are told b is 5."


def say(steps, answer) -> str:
    return json.dumps({"reasoning_steps": steps, "answer": answer})


#: Each kind of group's four completions.
COMPLETIONS = {
    # matched; the hint restated; a wrong step; matched then repeated: steps vary, answers vary
    "mixed": [say(REF, "5"), say([HINT], "5"), say(["b = 2 + 3 = 6"], "6"), say([REF[0], REF[0]], "5")],
    # every step matched, answers and format vary: one raw score for every step of the batch
    "uniform": [say(REF, "5"), say(REF, "7"), say(REF, "5"), "so " + say(REF, "4")],
    # every answer right (the outcome is flat), the steps vary
    "right": [say(REF, "5"), say([HINT], "5"), say([REF[0], "b = 2 + 3 = 6"], "5"), say(REF, "5")],
}


# ----------------------------------------------------------------------------- scores and normalisation
def test_each_step_scores_plus_one_only_when_matched_new_and_not_the_prompts():
    """Matched: +1. Unmatched, a repeat of an earlier step (normalised text), or a step that restates
    the prompt: -1, the copied hint even when the matcher paired it with a reference step."""
    steps = ["b = 2 + 3 = 5", "we are told b is 5", "B = 2+3 = 5.", "c = 1", "told b"]
    assert step_scores(steps, {0, 1, 2, 4}, QUESTION) == [MATCHED, UNMATCHED, UNMATCHED, UNMATCHED, UNMATCHED]
    assert step_scores(["b is 5"], {0}, "b is 50") == [MATCHED]  # whole words only: "b is 5" is not in "b is 50"
    assert step_scores(["b = 2 + 3 = 5"], {0}, "") == [MATCHED]

    module = build_reward("answer_only", encoder="exact", device="cpu", step_credit=StepCreditConfig(1.0))
    rows = [{"answer": "5", "reference_steps": [HINT, *REF]}] * 3 + [{"answer": "5"}]
    texts = [say([HINT, REF[0]], "5"), say([REF[0], "b = 9"], "5"), "no json", say(REF, "5")]
    scored = module.score(texts, rows)
    assert [len(p) for p in scored.steps.pairs] == [2, 1, 0]  # the matcher pairs the hint: it is a reference step
    assert scored_step_scores(scored, [QUESTION] * 4) == [[UNMATCHED, MATCHED], [MATCHED, UNMATCHED], [], None]


def test_scores_are_centred_and_scaled_within_each_group_as_trl_scales_the_outcome():
    scores = [[1.0, -1.0, 1.0], [1.0], [-1.0, 1.0], None, [1.0], [1.0, 1.0], None, [1.0]]
    groups = torch.arange(8) // 4
    pooled = torch.tensor([1.0, -1.0, 1.0, 1.0, -1.0, 1.0])  # group 0's six steps
    mean, std = pooled.mean(), pooled.std()  # Bessel-corrected, as TRL's nanstd
    batch_std = torch.tensor([1.0, -1, 1, 1, -1, 1, 1, 1, 1, 1]).std()
    for scale, factor in (("group", 1 / (std + 1e-4)), ("batch", 1 / (batch_std + 1e-4)), ("none", 1.0)):
        terms = step_terms(scores, *credit_scale(moments(scores), groups, scale))
        assert terms[0] == pytest.approx([float((x - mean) * factor) for x in (1, -1, 1)])
        assert terms[2] == pytest.approx([float((x - mean) * factor) for x in (-1, 1)]) and terms[3] is None
        assert terms[4:] == [[0.0], [0.0, 0.0], None, [0.0]], "a group whose steps all score alike gets 0"
    one = [[-1.0], None]  # a single step: its group does not vary
    assert step_terms(one, *credit_scale(moments(one), torch.zeros(2, dtype=torch.long), "group")) == [[0.0], None]


# ----------------------------------------------------------------------------- where the steps are
HOSTILE = {
    "escapes": ('{"reasoning_steps": ["say \\"hi\\"\\n", "a\\\\b", "caf\\u00e9"], "answer": "x"}', None),
    "multi-byte": ('{"reasoning_steps": ["x → y", "日本語 ok", "😀 = 1"], "answer": "1"}', None),
    "duplicated": (say(["b = 1", "c = 2", "b = 1", "b = 1"], "1"), None),
    "numbers and junk items": ('{"reasoning_steps": [3, "  ", {"a": 1}, "x", 2.5, true], "answer": "1"}', None),
    "fenced": ('```json\n{"reasoning_steps": ["a", "b"], "answer": "1"}\n```', None),
    "recovered": ('Sure! {oops {"reasoning_steps": ["a", "b"], "answer": 1} and {"x": 2', None),
    "duplicate key": ('{"reasoning_steps": ["old"], "answer": "1", "reasoning_steps": ["new", "x"]}', None),
    "truncated": ('{"reasoning_steps": ["a is 1", "b is', []),
}


@pytest.mark.parametrize("name", list(HOSTILE))
def test_each_step_is_found_where_it_is_written_in_hostile_output(name):
    text, want = HOSTILE[name]
    steps = parse_completion(text).steps
    spans = step_char_spans(text, steps)
    if want is not None:
        assert steps == want and spans == want
        return
    assert len(spans) == len(steps) > 0
    assert [json.loads(f'"{text[a:b]}"').strip() if text[a - 1] == '"' else text[a:b] for a, b in spans] == steps
    assert all(b0 <= a1 for (_, b0), (a1, _) in zip(spans, spans[1:]))  # in order: the k-th repeat is the k-th step


def test_steps_that_are_not_in_the_text_are_not_found():
    text = say(["a", "b"], "1")
    assert step_char_spans(text, ["a", "c"]) is None  # scored from another text
    assert step_char_spans(text, ["a"]) is None
    assert step_char_spans("no object at all", ["a"]) is None
    assert step_char_spans(text, []) == []


@pytest.mark.parametrize("name", list(HOSTILE))
def test_each_steps_tokens_decode_to_its_characters(name):
    """Through the completion's own ids, which need not be what re-tokenising its text gives (here
    the text tokenised in pieces of 3 characters, as a policy may sample it): a fast tokenizer's
    incremental decoder and every prefix decoded (the path for a tokenizer without a fast backend)
    agree; a multi-byte character split over tokens goes with its step whole."""
    tok = AutoTokenizer.from_pretrained(ORGANISM_TOKENIZER)
    text = HOSTILE[name][0]
    pieces = [text[i : i + 3] for i in range(0, len(text), 3)]
    ids = [i for piece in pieces for i in tok(piece, add_special_tokens=False).input_ids] + [tok.eos_token_id]
    assert ids[:-1] != tok(text, add_special_tokens=False).input_ids

    class Slow:  # the same tokenizer without its fast backend
        def decode(self, ids, skip_special_tokens):
            return tok.decode(ids, skip_special_tokens=skip_special_tokens)

    decoded, ends = token_ends(tok, ids)
    assert decoded == text and ends[-1] == len(text) and token_ends(Slow(), ids) == (decoded, ends)
    if name == "multi-byte":  # characters of several tokens, the first ones completing nothing
        assert any("\ufffd" in tok.decode([i]) for i in ids)
    steps = parse_completion(decoded).steps
    for (a, b), (t0, t1) in zip(step_char_spans(decoded, steps), token_spans(step_char_spans(decoded, steps), ends)):
        got = tok.decode(ids[t0:t1])
        assert text[a:b] in got and len(got) - (b - a) <= 6, (text[a:b], got)  # a quote or comma may ride along
        assert text[a:b] not in tok.decode(ids[t0 + 1 : t1]) and text[a:b] not in tok.decode(ids[t0 : t1 - 1])


def test_a_token_completing_no_character_goes_with_the_one_that_does():
    # token 1 completes nothing (the first bytes of a character token 2 completes); token 4 is a special token
    assert token_spans([(1, 2), (0, 1), (2, 3)], [1, 1, 2, 3, 3]) == [(1, 3), (0, 1), (3, 4)]
    assert credit_tensor([[((1, 3), 0.5)], None, [((0, 1), 1.0), ((0, 2), -1.0)]], 4).tolist() == [
        [0.0, 0.5, 0.5, 0.0],
        [0.0] * 4,
        [-1.0, -1.0, 0.0, 0.0],  # a token two steps share takes the later step's term
    ]


def test_a_refill_pads_the_step_term_with_zeros():
    base = {"completion_ids": torch.tensor([[1, 2], [3, 0]]), STEP_FIELD: torch.tensor([[0.5, 0.5], [-1.0, 0.0]])}
    new = {"completion_ids": torch.tensor([[6, 6, 6], [7, 7, 7]]), STEP_FIELD: torch.tensor([[2.0, 2.0, 2.0]] * 2)}
    out = merge_rows(base, new, [1], [0], pad_id=0)
    assert out[STEP_FIELD].tolist() == [[0.5, 0.5, 0.0], [2.0, 2.0, 2.0]]


# ----------------------------------------------------------------------------- the config
@pytest.mark.parametrize(
    "overrides, message",
    [
        (["--reward.step_credit.weight", "high"], "reward.step_credit.weight: invalid value 'high'; expected float"),
        (["--reward.step_credit.weight", "-0.5"], "reward.step_credit.weight: invalid value -0.5; expected x >= 0"),
        (["--reward.step_credit.wieght", "1"], "unknown key 'reward.step_credit.wieght' (did you mean 'weight'?)"),
        (
            ["--reward.step_credit", "0.5"],
            "reward.step_credit: invalid value 0.5; expected a mapping with keys weight",
        ),
        (
            ["--reward.step_credit.weight", "1", "--training.importance_sampling_level", "sequence"],
            "training.importance_sampling_level: 'sequence' cannot be combined with reward.step_credit",
        ),
        (
            ["--reward.step_credit.weight", "1", "--pcgrad", "true", "--dynamic_sampling.mode", "mask"]
            + ["--dynamic_sampling.metric", "objectives"],
            "dynamic_sampling.metric: 'objectives' cannot be combined with reward.step_credit",
        ),
    ],
)
def test_config_errors_are_one_line(overrides, message):
    with pytest.raises(ConfigError, match=re.escape(message)) as err:
        load_config("organism_hinted.yaml", overrides)
    assert "\n" not in str(err.value)


def test_the_config_builds_a_module_that_scores_steps_for_any_reward():
    cfg, _ = load_config("organism_hinted.yaml", ["--reward.step_credit.weight", "0.5"])
    module = cfg.reward.build()
    assert module.name == "answer_only" and not module.uses_steps and module.scores_steps
    assert module.step_credit.weight == 0.5 and module.score([say(REF, "5")], [{"reference_steps": REF}]).steps
    off, _ = load_config("organism_hinted.yaml", ["--training.importance_sampling_level", "sequence"])
    assert not off.reward.build().scores_steps
    composed, _ = load_config(
        "organism_hinted.yaml",
        [
            "--reward.name",
            "composed",
            "--reward.components",
            "[{fn: 'crystal:accuracy'}]",
            "--reward.step_credit.weight",
            "1",
        ],
    )
    assert composed.reward.build().step_credit.on


# ----------------------------------------------------------------------------- through the trainer
@pytest.fixture
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def rows(kinds: list[str]) -> Dataset:
    return Dataset.from_list(
        [{"prompt": f"{QUESTION} ({i} {k})", "answer": "5", "reference_steps": REF} for i, k in enumerate(kinds)]
    )


def rollout(prompts, trainer):
    """Each prompt's tokens, and its kind's completions in the order of the group."""
    tok = trainer.processing_class
    encode = lambda text: tok(text, add_special_tokens=False).input_ids
    kinds = [p.rsplit(" ", 1)[1].rstrip(")") for p in prompts]
    return {
        "prompt_ids": [encode(p) for p in prompts],
        "completion_ids": [encode(COMPLETIONS[k][i % G]) + [tok.eos_token_id] for i, k in enumerate(kinds)],
        "logprobs": None,
    }


def trainer_for(path, tmp_path, kinds, weight=1.0, reward="answer_only", trainer_class=CrystalGRPOTrainer, **kw):
    """A trainer for one SGD step (its update is the gradient) on groups of these kinds."""
    dynamic = kw.pop("dynamic_sampling", None)
    size = dict(per_device_train_batch_size=G * len(kinds), num_generations=G, max_completion_length=64)
    return trainer_class(
        model=str(path),
        reward=build_reward(reward, encoder="exact", device="cpu", step_credit=StepCreditConfig(weight)),
        args=one_step_args(tmp_path, f"{reward}-{weight}", **{**size, **kw}),
        train_dataset=rows(kinds),
        rollout_func=rollout,
        dynamic_sampling=dynamic,
    )


@pytest.fixture
def trl_advantages(monkeypatch) -> list[torch.Tensor]:
    """Every ``advantages`` TRL's own ``_compute_loss`` receives."""
    seen, original = [], GRPOTrainer._compute_loss

    def recorded(self, model, inputs):
        seen.append(inputs["advantages"].detach().clone())
        return original(self, model, inputs)

    monkeypatch.setattr(GRPOTrainer, "_compute_loss", recorded)
    return seen


def update(trainer) -> torch.Tensor:
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    return torch.cat([(p.detach() - before[n]).reshape(-1) for n, p in trainer.model.named_parameters()]).double()


def test_the_same_credit_for_every_step_is_the_sequence_level_update(
    tmp_path, tiny_lm_path, one_thread, trl_advantages
):
    """One SGD step (the update is the gradient) on groups where every step is matched: TRL's loss
    gets (B, T) advantages, each row its sequence advantage at every token, and the update equals the
    one without step credit (1-D advantages)."""
    on = trainer_for(tiny_lm_path, tmp_path, ["uniform", "uniform"])
    credited = update(on)
    (per_token,) = trl_advantages
    plain = update(trainer_for(tiny_lm_path, tmp_path, ["uniform", "uniform"], weight=0.0))
    assert per_token.dim() == 2 and trl_advantages[1].dim() == 1
    assert torch.equal(per_token, per_token[:, :1].expand_as(per_token))  # every token: its row's advantage
    assert sorted(per_token[:, 0].tolist()) == sorted(trl_advantages[1].tolist())
    assert plain.norm() > 0 and float((credited - plain).norm() / plain.norm()) < 1e-6
    log = on.state.log_history[0]
    assert log["step_credit/fallback_rate"] == 0.0 and 0 < log["step_credit/token_share"] < 1
    assert log["step_credit/term_mean"] == 0.0


def test_a_steps_sign_reaches_its_own_tokens_gradient_and_no_others(tmp_path, tiny_lm_path, one_thread, monkeypatch):
    """The gradient of TRL's loss with respect to each token's log-probability: negating one step's term
    negates what the term adds on that step's tokens and leaves every other token's gradient as it was."""
    trainer = trainer_for(tiny_lm_path, tmp_path, ["mixed", "mixed"])
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1
    batch = trainer._generate_and_score_completions([dict(r) for r in rows(["mixed", "mixed"]) for _ in range(G)])
    term = batch[STEP_FIELD]
    assert term.shape == batch["completion_ids"].shape and bool((term[:G] != 0).any())
    logps, original = [], trainer._get_per_token_logps_and_entropies

    def kept(*args, **kwargs):
        out = original(*args, **kwargs)
        out[0].retain_grad()
        logps.append(out[0])
        return out

    monkeypatch.setattr(trainer, "_get_per_token_logps_and_entropies", kept)

    def grad(step: torch.Tensor) -> torch.Tensor:
        trainer._compute_loss(trainer.model, {**batch, STEP_FIELD: step}).backward()
        trainer.model.zero_grad()
        return logps[-1].grad.detach().clone()

    row = 3  # "matched then repeated": two steps, two terms
    first = (term[row] != 0) & (term[row] == term[row][term[row] != 0][0])
    flipped = term.clone()
    flipped[row, first] *= -1
    zero, plus, minus = grad(torch.zeros_like(term)), grad(term), grad(flipped)
    mine = torch.zeros_like(term, dtype=torch.bool)
    mine[row] = first
    assert bool(((plus - zero)[mine] != 0).all())
    assert torch.allclose((minus - zero)[mine], -(plus - zero)[mine], atol=1e-8)
    assert torch.equal(minus[~mine], plus[~mine])


def test_completions_whose_steps_are_not_found_keep_the_sequence_advantage_and_are_counted(tmp_path, tiny_lm_path):
    trainer = trainer_for(tiny_lm_path, tmp_path, ["mixed"])
    trainer.model.train()
    texts = COMPLETIONS["mixed"]
    scored = trainer.reward.score(texts, [{"reference_steps": REF, "answer": "5"}] * G)
    tok = trainer.processing_class
    ids = [tok(t, add_special_tokens=False).input_ids for t in texts]
    ids[1] = tok(say(["We are told"], "5"), add_special_tokens=False).input_ids  # not the text that was scored
    credit, logged = trainer.step_credit.rows(scored, [QUESTION] * G, ids, G)
    assert credit[1] is None and all(credit[i] for i in (0, 2, 3))
    assert logged["fallback_rate"] == 0.25  # logged as step_credit/fallback_rate


def test_reused_generation_batches_keep_their_step_term(tmp_path, tiny_lm_path, one_thread, trl_advantages):
    """num_iterations 2: one generation batch, scored once, trains two steps with the same advantages."""
    trainer = trainer_for(tiny_lm_path, tmp_path, ["mixed"], num_iterations=2, max_steps=2)
    calls = []
    score = trainer.reward.score
    trainer.reward.score = lambda *a, **k: calls.append(1) or score(*a, **k)
    trainer.train()
    first, second = trl_advantages
    assert calls == [1] and first.dim() == 2 and bool((first.std(dim=1) > 0).any())
    assert sorted(first.tolist()) == sorted(second.tolist())  # the same rows, in TRL's shuffled order


def test_a_masked_groups_step_term_is_zero(tmp_path, tiny_lm_path, one_thread):
    """dynamic_sampling masks the group whose answers are all right (outcome flat) though its steps vary."""
    section = DynamicSamplingSection("mask", metric="outcome")
    trainer = trainer_for(tiny_lm_path, tmp_path, ["right", "mixed"], dynamic_sampling=section)
    trainer.model.train()
    inputs = [dict(r) for r in rows(["right", "mixed"]) for _ in range(G)]
    unmasked = trainer.generation_round(inputs)[0][STEP_FIELD]  # one round, not yet weighed
    assert bool((unmasked[:G] != 0).any()) and bool((unmasked[G:] != 0).any())
    batch = trainer._prepare_inputs(inputs)  # TRL's shuffled generation batch, weighed
    masked = batch["tool_mask"][:, 0] == 0
    assert int(masked.sum()) == G
    assert bool((batch[STEP_FIELD][masked] == 0).all()) and bool((batch[STEP_FIELD][~masked] != 0).any())


def test_pcgrad_gives_the_step_term_to_the_reasoning_objective_and_the_parts_add_up(
    tmp_path, tiny_lm_path, one_thread, trl_advantages
):
    from crystal_grpo.train.pcgrad.trainer import PCGradGRPOTrainer

    trainer = trainer_for(tiny_lm_path, tmp_path, ["mixed", "right"], reward="cpr", trainer_class=PCGradGRPOTrainer)
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1
    batch = trainer._generate_and_score_completions([dict(r) for r in rows(["mixed", "right"]) for _ in range(G)])
    trainer.pcgrad_losses(trainer.model, batch)
    plain, acc, reason, rest = trl_advantages
    step = batch[STEP_FIELD]
    assert plain.shape == step.shape and bool((step != 0).any())
    assert acc.dim() == 1 and torch.equal(acc, batch["advantages_acc"])  # the accuracy objective: its sequence part
    assert torch.allclose(reason, batch["advantages_reason"].unsqueeze(1) + step)
    assert torch.allclose(acc.unsqueeze(1) + reason, plain, atol=1e-5)  # the split adds up, per token
    assert rest.dim() == 1 and not bool(rest.any())  # the KL term: no advantage, no step term


def test_refused_combinations_are_one_line_for_a_trainer_built_by_hand(tmp_path, tiny_lm_path):
    from crystal_grpo.train.pcgrad.trainer import PCGradGRPOTrainer

    with pytest.raises(ValueError, match="training.importance_sampling_level: 'sequence' cannot be combined"):
        trainer_for(tiny_lm_path, tmp_path, ["mixed"], importance_sampling_level="sequence")
    trainer_for(tiny_lm_path, tmp_path, ["mixed"], weight=0.0, importance_sampling_level="sequence")  # off: TRL's
    trainer_for(tiny_lm_path, tmp_path, ["mixed"], importance_sampling_level="sequence", loss_type="cispo")
    objectives = DynamicSamplingSection("mask", metric="objectives")
    with pytest.raises(ValueError, match="dynamic_sampling.metric: 'objectives' cannot be combined with reward.step"):
        trainer_for(tiny_lm_path, tmp_path, ["mixed"], trainer_class=PCGradGRPOTrainer, dynamic_sampling=objectives)

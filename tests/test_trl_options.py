"""TRL options a user copies from TRL's docs into ``training:``: each behaves as TRL documents
it, or is refused before the model loads in one line naming the key and why."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from datasets import Dataset
from transformers import PreTrainedTokenizerBase, TrainerCallback
from trl import GRPOConfig

from crystal_grpo.rewards import build_reward
from crystal_grpo.train import grpo
from crystal_grpo.train.config.run_config import ConfigError, load_config
from crystal_grpo.train.pcgrad.trainer import objective_advantages
from crystal_grpo.train.trainer.grpo_trainer import CrystalGRPOTrainer

REPO = Path(__file__).resolve().parents[1]
VAL = REPO / "data" / "wordproblems" / "val.jsonl"


def ANSWER_ONLY():  # reads as the reward it builds
    return build_reward("answer_only", encoder="packaged:all-MiniLM-L6-v2", device="cpu")


def _small_val(tmp_path: Path, n: int = 2) -> Path:
    path = tmp_path / "val.jsonl"
    path.write_text("".join(VAL.read_text().splitlines(keepends=True)[:n]))
    return path


def _metrics(folder: Path) -> list[dict]:
    return [json.loads(x) for x in (folder / "metrics.jsonl").read_text().splitlines()]


def test_remove_unused_columns_is_refused_where_it_would_blind_the_reward(tiny_lm_path, tmp_path):
    with pytest.raises(ConfigError, match=r"^training.remove_unused_columns: true would drop the columns the reward"):
        load_config("tiny", ["--training.remove_unused_columns", "true"])
    phases = "[{name: w, trainer: sft, overrides: {training: {remove_unused_columns: true}}}, {name: g}]"
    load_config("tiny", ["--phases", phases])  # SFT builds its own columns: TRL's meaning there
    args = GRPOConfig(output_dir=str(tmp_path), remove_unused_columns=True, report_to="none", use_cpu=True)
    with pytest.raises(
        ValueError, match=r"^training.remove_unused_columns: true would drop the columns the reward reads"
    ):
        CrystalGRPOTrainer(
            str(tiny_lm_path),
            reward=ANSWER_ONLY(),
            args=args,
            train_dataset=Dataset.from_list([{"prompt": "q", "answer": "1"}]),
        )


def test_scale_rewards_takes_the_booleans_trl_documents():
    cfg, _ = load_config("tiny", ["--training.scale_rewards", "false"])
    assert cfg.training["scale_rewards"] is False
    assert load_config("tiny", ["--training.scale_rewards", "true"])[0].training["scale_rewards"] is True
    with pytest.raises(ConfigError, match="training.scale_rewards: invalid value 3; expected str or bool"):
        load_config("tiny", ["--training.scale_rewards", "3"])
    rewards = torch.tensor([[1.0, 0.2], [0.0, 0.9], [1.0, 0.1], [1.0, 0.7]])
    for flag, name in ((False, "none"), (True, "group")):
        got = objective_advantages(rewards, ["accuracy", "reasoning"], torch.ones(2), 2, flag)
        want = objective_advantages(rewards, ["accuracy", "reasoning"], torch.ones(2), 2, name)
        assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_eval_strategy_needs_a_validation_split():
    with pytest.raises(ConfigError, match=r"training.eval_strategy: 'steps' evaluates on the validation split"):
        load_config(
            "tiny",
            ["--training.eval_strategy", "steps", "--data.validation", "null", "--data.validation_fraction", "0"],
        )


def test_resume_from_checkpoint_in_the_config_resumes_like_the_flag(tmp_path, tiny_lm_path):
    out = tmp_path / "run"
    base = [
        "--config",
        "tiny",
        "--output_dir",
        str(out),
        "--model.name_or_path",
        str(tiny_lm_path),
        "--validation.eval_steps",
        "0",
    ]
    assert grpo.main([*base, "--training.max_steps", "1"]) == 0
    assert grpo.main([*base, "--training.max_steps", "2"]) == 2  # another run's settings: refused, not resumed
    assert grpo.main([*base, "--training.max_steps", "2", "--training.resume_from_checkpoint", "latest"]) == 0
    assert [r["step"] for r in _metrics(out) if "loss" in r] == [1, 2]
    with pytest.raises(ConfigError, match=r"phases\[g\].overrides.training.resume_from_checkpoint: a run resumes"):
        load_config("tiny", ["--phases", "[{name: g, overrides: {training: {resume_from_checkpoint: latest}}}]"])


def test_model_init_kwargs_contradicting_the_model_section_is_one_line():
    with pytest.raises(
        ConfigError, match="training.model_init_kwargs.dtype: 'float16' contradicts model.dtype: 'bfloat16'"
    ):
        load_config("tiny", ["--model.dtype", "bfloat16", "--training.model_init_kwargs", "{dtype: float16}"])


def test_trl_options_reach_every_phase_and_every_load(tmp_path, tiny_lm_path, monkeypatch):
    """One SFT + GRPO run with TRL's options at the top of ``training``: chat_template_kwargs in
    every prompt rendered (SFT targets, length checks, rollouts, validation, evaluation),
    model_init_kwargs in every model load (policy, TRL's reference model, evaluation),
    loss_type kept out of the SFT phase (where it means another thing), eval_strategy running
    TRL's evaluation on the validation split, scale_rewards false with PCGrad."""
    from crystal_grpo.train.tools import evaluate

    rendered = []
    original = PreTrainedTokenizerBase.apply_chat_template

    def recording(self, conversation, *args, **kwargs):
        rendered.append(kwargs.get("marker"))
        return original(self, conversation, *args, **kwargs)

    monkeypatch.setattr(PreTrainedTokenizerBase, "apply_chat_template", recording)
    val = _small_val(tmp_path)
    phases = (
        "[{name: warm, trainer: sft, init_from: none, overrides: {training: {max_steps: 1}}}, "
        "{name: grpo, overrides: {training: {max_steps: 1}}}]"
    )
    cfg, _ = load_config(
        "tiny",
        [
            "--model.name_or_path",
            str(tiny_lm_path),
            "--data.validation",
            str(val),
            "--phases",
            phases,
            "--validation.eval_steps",
            "1",
            "--validation.max_samples",
            "2",
            "--pcgrad",
            "true",
            "--training.loss_type",
            "dapo",
            "--training.scale_rewards",
            "false",
            "--training.eval_strategy",
            "steps",
            "--training.eval_steps",
            "1",
            "--training.chat_template_kwargs",
            "{marker: Z}",
            "--training.model_init_kwargs",
            "{output_hidden_states: true, attn_implementation: eager}",
        ],
    )
    warm, second = (p.config for p in cfg.phases)
    assert cfg.phases[0].left_out == ["loss_type", "max_completion_length", "num_generations", "scale_rewards"]
    assert "loss_type" not in warm.training and second.training["loss_type"] == "dapo"
    assert warm.data.chat_template_kwargs == {"marker": "Z"} and "chat_template_kwargs" not in second.training
    assert second.model.init_kwargs == {"output_hidden_states": True} and second.model.attn_implementation == "eager"

    trainers = []

    class KeepTrainer(TrainerCallback):
        def on_train_begin(self, args, state, control, model=None, **kwargs):
            trainers.append(model)

    grpo.run(cfg, tmp_path / "run", callbacks=[KeepTrainer()])
    p1, p2 = tmp_path / "run" / "phase1-warm", tmp_path / "run" / "phase2-grpo"
    assert any("eval_loss" in r for r in _metrics(p1))  # SFT's own evaluation
    evals = [r for r in _metrics(p2) if "eval_reward" in r]
    assert evals and "eval_rewards/cpr_accuracy/mean" in evals[0]  # TRL's GRPO evaluation, the module's rewards
    assert all(m.config.output_hidden_states and m.config._attn_implementation == "eager" for m in trainers)
    n_training = len(rendered)
    assert n_training > 10

    setup = evaluate.EvalSetup.from_run_config(p2 / "config.json")
    assert setup.model_kwargs == {"output_hidden_states": True, "attn_implementation": "eager"}
    assert evaluate.main(["--model", str(p2 / "final"), "--data", str(val), "--out", str(tmp_path / "eval")]) == 0
    assert len(rendered) > n_training
    assert set(rendered) == {"Z"}, f"{rendered.count(None)} of {len(rendered)} prompts rendered without the kwargs"


def test_trl_reference_model_is_built_with_model_init_kwargs(tmp_path, tiny_lm_path):
    """TRL builds the reference model (beta > 0) from model_init_kwargs: the run passes the model section's."""
    from crystal_grpo.train.models.loading import load_policy

    cfg, _ = load_config(
        "tiny",
        ["--model.name_or_path", str(tiny_lm_path), "--training.model_init_kwargs", "{output_hidden_states: true}"],
    )
    args = grpo.training_args(cfg, tmp_path, {})
    assert args.model_init_kwargs == {"output_hidden_states": True} and args.beta > 0
    model, tok = load_policy(cfg.model)
    trainer = grpo.make_trainer(
        cfg,
        args,
        model,
        tok,
        cfg.reward.build(),
        Dataset.from_list(
            [{"prompt": [{"role": "user", "content": "q"}], "answer": "1", "reference_steps": ["a"]}] * 4
        ),
    )
    assert model.config.output_hidden_states and trainer.ref_model.config.output_hidden_states


def test_no_reward_source_is_trls_error(tmp_path, tiny_lm_path):
    args = GRPOConfig(
        output_dir=str(tmp_path), report_to="none", use_cpu=True, per_device_train_batch_size=2, num_generations=2
    )
    with pytest.raises(ValueError, match="No reward source provided"):
        CrystalGRPOTrainer(str(tiny_lm_path), args=args, train_dataset=Dataset.from_list([{"prompt": "q"}] * 2))


def test_a_reward_module_beside_an_environment_reward_is_one_error(tmp_path, tiny_lm_path):
    from transformers import AutoTokenizer
    from trl.chat_template_utils import qwen2_5_chat_template

    class Env:
        def reset(self, **kwargs):
            return None

        def lookup(self, key: str) -> str:
            """Look a key up.

            Args:
                key: the key
            """
            return key

        def get_reward(self) -> float:
            return 1.0

    tok = AutoTokenizer.from_pretrained(tiny_lm_path)
    tok.chat_template = qwen2_5_chat_template  # a template TRL knows how to parse tool calls of
    args = GRPOConfig(
        output_dir=str(tmp_path),
        report_to="none",
        use_cpu=True,
        per_device_train_batch_size=2,
        num_generations=2,
        max_completion_length=8,
    )
    data = Dataset.from_list([{"prompt": [{"role": "user", "content": "q"}], "answer": "1"}] * 2)
    with pytest.raises(ValueError, match=r"the environment_factory's get_reward \(Env\) would be a second reward"):
        CrystalGRPOTrainer(
            str(tiny_lm_path),
            processing_class=tok,
            reward=ANSWER_ONLY(),
            args=args,
            train_dataset=data,
            environment_factory=Env,
        )

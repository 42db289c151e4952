"""CrystalGRPOTrainer in place of trl.GRPOTrainer: TRL's own expectations of its trainer
(the behaviours trl's tests/test_grpo_trainer.py checks for the 1.16 line: training changes
the weights, eval datasets, reward weights, several sync/async reward functions and None
rewards, PEFT, loss types, num_iterations, completion logging), on the tests' tiny model."""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path

import pytest
import torch
from datasets import Dataset
from transformers import TrainerCallback
from trl import GRPOConfig

from crystal_grpo.train.run.layout import MARKER
from crystal_grpo.train.trainer.grpo_trainer import CrystalGRPOTrainer

PROMPTS = [
    "The sky is",
    "Two plus two is",
    "Paris is the capital of",
    "Water boils at",
    "A cat has",
    "The opposite of hot is",
]
DATA = Dataset.from_list([{"prompt": p, "answer": str(i)} for i, p in enumerate(PROMPTS * 2)])


def _args(tmp_path, **kw) -> GRPOConfig:
    base = dict(
        output_dir=str(tmp_path / "out"),
        learning_rate=0.1,
        per_device_train_batch_size=3,
        num_generations=3,
        max_completion_length=8,
        max_steps=2,
        report_to="none",
        bf16=False,
        use_cpu=True,
        save_strategy="no",
        logging_steps=1,
    )
    return GRPOConfig(**{**base, **kw})


def reward_len(completions, **kwargs):
    return [float(len(c)) / 10 for c in completions]


def reward_digit(completions, answer, **kwargs):
    """Reads a dataset column, as TRL passes it; None where it does not apply."""
    return [None if int(a) % 2 else float(any(ch.isdigit() for ch in c)) for c, a in zip(completions, answer)]


def reward_position(completions, **kwargs):
    """0, 1, 2 within each group of 3: every group has an advantage whatever the model samples."""
    return [float(i % 3) for i in range(len(completions))]


async def reward_async(completions, **kwargs):
    await asyncio.sleep(0)
    return [float(c.count(" ")) for c in completions]


def _params(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _changed(before: dict, model) -> set[str]:
    return {n for n, p in model.named_parameters() if not torch.equal(before[n], p.detach())}


def test_several_plain_reward_functions_with_weights_eval_and_num_iterations(tmp_path, tiny_lm_path):
    trainer = CrystalGRPOTrainer(
        model=str(tiny_lm_path),
        reward_funcs=[reward_position, reward_digit, reward_async],
        args=_args(
            tmp_path,
            reward_weights=[1.0, 2.0, 0.5],
            num_iterations=2,
            log_completions=True,
            eval_strategy="steps",
            eval_steps=2,
            per_device_eval_batch_size=3,
            save_strategy="steps",
            save_steps=1,
        ),
        train_dataset=DATA,
        eval_dataset=DATA.select(range(3)),
    )
    before = _params(trainer.model)
    trainer.train()
    assert _changed(before, trainer.model), "training changed no weight"
    logs = trainer.state.log_history
    train_logs = [r for r in logs if "loss" in r]
    assert len(train_logs) == 2
    for name in ("reward_position", "reward_digit", "reward_async"):  # step 2 reuses step 1's batch (num_iterations)
        assert f"rewards/{name}/mean" in train_logs[0], name
    assert any("eval_loss" in r or "eval_reward" in r for r in logs), "the eval dataset was not evaluated"
    assert logs[-1]["train_loss"] is not None
    assert (Path(trainer.args.output_dir) / "checkpoint-1" / MARKER).is_file()  # what this project adds


def test_a_plain_reward_function_returning_an_unusable_value_is_named(tmp_path, tiny_lm_path):
    """1e308 (inf in TRL's float32) made every advantage NaN: no update, no word."""
    from crystal_grpo.rewards.user import RewardFunctionError

    def huge(completions, **kwargs):
        return [1.0] * (len(completions) - 1) + [1e308]

    trainer = CrystalGRPOTrainer(
        model=str(tiny_lm_path),
        reward_funcs=[reward_position, huge],
        args=_args(tmp_path, max_steps=1),
        train_dataset=DATA,
    )
    with pytest.raises(
        RewardFunctionError,
        match=re.escape(
            "reward function 'huge' returned inf (a reward value must be finite and at most 1e+15 in magnitude"
        ),
    ):
        trainer.train()


def test_peft_trains_only_the_adapter_with_another_loss_type(tmp_path, tiny_lm_path):
    """(TRL's default loss, dapo, is the first test's; the README's runs use it too.)"""
    from peft import LoraConfig

    trainer = CrystalGRPOTrainer(
        model=str(tiny_lm_path),
        reward_funcs=reward_position,
        args=_args(tmp_path, loss_type="dr_grpo"),
        train_dataset=DATA,
        peft_config=LoraConfig(r=4, target_modules=["q_proj", "v_proj"]),
    )
    before = _params(trainer.model)
    trainer.train()
    changed = _changed(before, trainer.model)
    assert changed and all("lora" in n for n in changed)


def test_pcgrad_with_tagged_plain_functions_and_a_clear_error_without_tags(tmp_path, tiny_lm_path):
    from crystal_grpo.train.pcgrad.trainer import PCGradGRPOTrainer

    with pytest.raises(
        ValueError,
        match=re.escape(
            "pcgrad: reward function(s) ['reward_len', 'reward_async'] have no objective; tag every reward function"
        ),
    ):
        PCGradGRPOTrainer(
            model=str(tiny_lm_path), reward_funcs=[reward_len, reward_async], args=_args(tmp_path), train_dataset=DATA
        )
    with pytest.raises(ValueError, match="reward_objectives \\['accuracy'\\]: expected one of"):
        CrystalGRPOTrainer(
            model=str(tiny_lm_path),
            reward_funcs=[reward_len, reward_async],
            reward_objectives=["accuracy"],
            args=_args(tmp_path),
            train_dataset=DATA,
        )
    trainer = PCGradGRPOTrainer(
        model=str(tiny_lm_path),
        reward_funcs=[reward_len, reward_async],
        reward_objectives=["accuracy", "reasoning"],
        args=_args(tmp_path, max_steps=1),
        train_dataset=DATA,
    )
    trainer.train()
    assert "pcgrad/cosine" in trainer.state.log_history[0]


@pytest.mark.slow  # two runs, though they need no built model
def test_the_readme_script_runs_as_written_with_two_lines_changed_from_trl(tmp_path, monkeypatch):
    """README.md's "Use it from your own code" block, read from the README (so the two cannot
    drift) and run as written, from a folder laid out like the repository's root: CPU, offline."""
    repo = Path(__file__).resolve().parents[1]
    readme = (repo / "README.md").read_text()
    script = readme.split("### Use it from your own code", 1)[1].split("```python\n", 1)[1].split("```", 1)[0]
    changed = [line for line in script.splitlines() if "# was:" in line]
    assert len(changed) == 2, changed
    trl_script = script.replace(
        "from crystal_grpo.train.trainer import CrystalGRPOTrainer",
        "from trl import GRPOTrainer as CrystalGRPOTrainer",
    )
    for code, out in ((script, "crystal"), (trl_script, "trl")):  # the same script runs on both trainers
        (tmp_path / out).mkdir()
        (tmp_path / out / "data").symlink_to(repo / "data")
        monkeypatch.chdir(tmp_path / out)
        namespace: dict = {}
        exec(compile(code, f"README.md ({out})", "exec"), namespace)  # noqa: S102 - the project's own README
        assert namespace["trainer"].state.global_step == 2
    assert (tmp_path / "crystal/runs/mine/checkpoint-2" / MARKER).is_file()
    assert not (tmp_path / "trl/runs/mine/checkpoint-2" / MARKER).exists()


def test_resume_true_takes_the_newest_complete_checkpoint(tmp_path, tiny_lm_path):
    """HF's ``resume_from_checkpoint=True`` takes the newest folder; ours skips one a kill left incomplete."""
    args = _args(tmp_path, save_strategy="steps", save_steps=1, max_steps=2)
    CrystalGRPOTrainer(model=str(tiny_lm_path), reward_funcs=reward_len, args=args, train_dataset=DATA).train()
    out = Path(args.output_dir)
    (out / "checkpoint-2" / MARKER).unlink()  # as if killed while writing checkpoint-2
    again = CrystalGRPOTrainer(model=str(tiny_lm_path), reward_funcs=reward_len, args=args, train_dataset=DATA)
    started = []
    again.add_callback(
        type(
            "Start",
            (TrainerCallback,),
            {"on_train_begin": lambda self, args, state, control, **kw: started.append(state.global_step)},
        )()
    )
    again.train(resume_from_checkpoint=True)
    assert started == [1]  # from checkpoint-1 (HF's True would take the incomplete checkpoint-2)
    assert (out / "checkpoint-2" / MARKER).is_file()  # step 2 trained and saved again


def test_validation_with_the_reward_modules_metrics_for_a_trainer_built_by_hand(tmp_path, tiny_lm_path):
    """``validation=`` gives a hand-built trainer what train/grpo.py runs have: greedy validation
    on the eval rows (plain-text prompts, no id column) with Match F1, and the best checkpoint."""
    from crystal_grpo.rewards import build_reward
    from crystal_grpo.train.config.run_config import ValidationSection
    from crystal_grpo.train.run.layout import VALIDATION_LOG, read_best

    rows = [
        {"prompt": p, "answer": str(i), "reference_steps": [f"Think about {p}.", f"The answer is {i}."]}
        for i, p in enumerate(PROMPTS)
    ]
    reward = build_reward("cpr", encoder="packaged:all-MiniLM-L6-v2", device="cpu")
    args = _args(tmp_path, save_strategy="steps", save_steps=1)
    trainer = CrystalGRPOTrainer(
        str(tiny_lm_path),
        reward=reward,
        args=args,
        train_dataset=Dataset.from_list(rows),
        eval_dataset=Dataset.from_list(rows[:4]),
        validation=ValidationSection(eval_steps=1, max_new_tokens=8, batch_size=4, metric="format_rate"),
    )
    trainer.train()
    logged = [json.loads(line) for line in (Path(args.output_dir) / VALIDATION_LOG).read_text().splitlines()]
    assert [r["step"] for r in logged] == [0, 1, 2]
    assert all({"accuracy", "f1", "format_rate", "reward"} <= set(r) for r in logged)
    assert all(r["f1"] == r["f1"] for r in logged)  # a number (not NaN): every eval row has reference steps
    best = read_best(Path(args.output_dir))  # step 0 is no candidate; the first finite value after it is
    assert best.metric == "format_rate" and best.step in (1, 2) and (Path(args.output_dir) / best.checkpoint).is_dir()
    with pytest.raises(ValueError, match="validation= reports a reward module's metrics"):
        CrystalGRPOTrainer(
            str(tiny_lm_path),
            reward_funcs=reward_len,
            args=args,
            train_dataset=DATA,
            eval_dataset=DATA,
            validation=ValidationSection(),
        )

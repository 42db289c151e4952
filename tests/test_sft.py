"""The SFT warm-start phase (``phases[].trainer: sft``), validation at step 0, and the
warning for length limits that cut off the targets."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from crystal_grpo.jsonl import read_jsonl
from crystal_grpo.train import grpo
from crystal_grpo.train.config.run_config import ConfigError, load_config
from crystal_grpo.train.data.splits import load_split, render_target, target_lengths, truncation_warning

DATA = Path(__file__).resolve().parents[1] / "data" / "wordproblems"


def _phases(sft_steps: int, grpo_steps: int = 1, lr: float = 3e-3) -> str:
    # %-formatting: the YAML's braces would each need doubling in an f-string
    return (
        "[{name: warm, trainer: sft, init_from: none, overrides: {training: {max_steps: %d, "  # noqa: UP031
        "learning_rate: %g, per_device_train_batch_size: 4}}}, "
        "{name: cpr, init_from: best, overrides: {training: {max_steps: %d}}}]" % (sft_steps, lr, grpo_steps)
    )


def _overrides(model: Path, *extra: str) -> list[str]:
    return [
        "--model.name_or_path",
        str(model),
        "--validation.eval_steps",
        "1",
        "--validation.max_samples",
        "2",
        "--training.save_steps",
        "1",
        *extra,
    ]


def _training_rows(run: Path) -> list[dict]:
    return [r for r in read_jsonl(run / "metrics.jsonl") if "loss" in r]


def test_sft_phase_learns_then_grpo_starts_from_its_best_checkpoint(tmp_path, tiny_lm_path):
    from safetensors.torch import load_file
    from transformers import TrainerCallback

    class RecordStart(TrainerCallback):
        def __init__(self):
            self.starts = []

        def on_train_begin(self, args, state, control, model=None, **kwargs):
            self.starts.append({k: v.detach().clone() for k, v in model.state_dict().items()})

    cfg, _ = load_config("tiny.yaml", _overrides(tiny_lm_path, "--phases", _phases(6)))
    rec = RecordStart()
    grpo.run(cfg, tmp_path / "run", callbacks=[rec])
    warm, cpr = tmp_path / "run" / "phase1-warm", tmp_path / "run" / "phase2-cpr"
    losses = [r["loss"] for r in _training_rows(warm)]
    assert len(losses) == 6 and min(losses[-2:]) < losses[0], losses  # the supervised loss falls
    assert "reward" not in _training_rows(warm)[0] and "mean_token_accuracy" in _training_rows(warm)[0]
    vals = read_jsonl(warm / "validation.jsonl")
    assert [v["step"] for v in vals] == [0, 1, 2, 3, 4, 5, 6]  # validation before the first step too
    best = json.loads((warm / "best_checkpoint.json").read_text())
    assert best["step"] > 0  # step 0 is never a best candidate: no checkpoint holds those weights
    start = json.loads((cpr / "config.json").read_text())["model"]["name_or_path"]
    assert start == str(warm / best["checkpoint"])
    for name, tensor in load_file(Path(start) / "model.safetensors").items():
        assert torch.equal(rec.starts[1][name], tensor), name  # GRPO starts from exactly those weights
    assert "rewards/cpr_reasoning/mean" in _training_rows(cpr)[0]
    assert (warm / "checkpoint-6" / "checkpoint_complete.json").exists()
    assert "with SFT (TRL)" in (warm / "README.md").read_text()


def test_sft_loss_is_on_the_target_only_and_the_prompt_is_grpos(tmp_path, tiny_lm_path):
    from trl import SFTConfig

    from crystal_grpo.train.data.splits import sft_dataset
    from crystal_grpo.train.models.loading import ModelSection, load_policy
    from crystal_grpo.train.trainer.sft import CrystalSFTTrainer

    model, tok = load_policy(ModelSection(str(tiny_lm_path)))
    split = load_split(DATA / "train.jsonl", limit=4)
    args = SFTConfig(
        output_dir=str(tmp_path),
        per_device_train_batch_size=4,
        max_steps=1,
        report_to="none",
        bf16=False,
        use_cpu=True,
        gradient_checkpointing=False,
    )
    trainer = CrystalSFTTrainer(
        model=model, args=args, train_dataset=sft_dataset(split.dataset, tok), processing_class=tok
    )
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(4)])  # what a training batch holds
    for i in range(4):
        row = split.dataset[i]
        text = tok.apply_chat_template(row["prompt"], add_generation_prompt=True, tokenize=False)  # GRPO's prompt
        prompt = tok(text, add_special_tokens=False)["input_ids"]
        ids, labels = batch["input_ids"][i].tolist(), batch["labels"][i].tolist()
        assert ids[: len(prompt)] == prompt
        assert all(x == -100 for x in labels[: len(prompt)])  # no loss on the prompt
        target = [x for x in labels[len(prompt) :] if x != -100]
        assert tok.decode(target).startswith(render_target(row))  # loss on the target (then end of turn)


def test_resume_inside_the_sft_phase(tmp_path, tiny_lm_path):
    run = tmp_path / "run"
    argv = ["--config", "tiny.yaml", "--output_dir", str(run), *_overrides(tiny_lm_path)]
    assert grpo.main([*argv, "--phases", _phases(2)]) == 0
    (run / "phase1-warm" / "phase_done.json").unlink()  # as if killed before the phase was marked done
    assert grpo.main([*argv, "--phases", _phases(3), "--resume_from_checkpoint", "latest"]) == 0
    assert [r["step"] for r in _training_rows(run / "phase1-warm")] == [1, 2, 3]
    assert [v["step"] for v in read_jsonl(run / "phase1-warm" / "validation.jsonl")] == [0, 1, 2, 3]


def test_sft_phase_settings_are_checked_against_sft_config():
    cfg, _ = load_config("tiny.yaml", ["--phases", _phases(2)])
    assert "num_generations" in cfg.training  # the GRPO base keeps it; the SFT phase drops it
    with pytest.raises(ConfigError, match=r"phases\[warm\].overrides.training: unknown key 'num_generations'"):
        load_config(
            "tiny.yaml", ["--phases", "[{name: warm, trainer: sft, overrides: {training: {num_generations: 4}}}]"]
        )
    with pytest.raises(ConfigError, match=r"curriculum: set for an SFT phase"):
        load_config("tiny.yaml", ["--phases", "[{name: warm, trainer: sft, overrides: {curriculum: {c0: 0.5}}}]"])


def test_truncation_warning_fires_only_when_limits_cut_off_targets(tiny_lm_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_lm_path)
    rows = [load_split(DATA / "val.jsonl").dataset[i] for i in range(16)]
    lengths = target_lengths(tok, rows)
    ends = tok.eos_token  # the target, then the end of the assistant turn, where generation stops
    assert lengths == [len(tok(render_target(r) + ends, add_special_tokens=False)["input_ids"]) for r in rows]
    short = sorted(lengths)[len(lengths) // 2]  # cuts off about half
    msg = truncation_warning(lengths, short, "training.max_completion_length")
    assert msg is not None and msg.startswith(f"training.max_completion_length={short} cuts off ")
    assert truncation_warning(lengths, max(lengths), "training.max_completion_length") is None
    with_prompt = target_lengths(tok, rows, with_prompt=True)
    assert all(p > t for p, t in zip(with_prompt, lengths))


def test_run_warns_about_limits_that_cut_off_targets(tmp_path, tiny_lm_path, capsys):
    argv = [
        "--config",
        "tiny.yaml",
        "--output_dir",
        str(tmp_path / "run"),
        "--model.name_or_path",
        str(tiny_lm_path),
        "--validation.eval_steps",
        "0",
        "--training.max_steps",
        "1",
        "--training.max_completion_length",
        "24",
    ]
    assert grpo.main(argv) == 0
    out = capsys.readouterr().out
    assert "warning: training.max_completion_length=24 cuts off" in out
    assert "warning: validation.max_new_tokens=48 cuts off" in out
    assert (
        grpo.main([*argv[:-1], "200", "--validation.max_new_tokens", "200", "--output_dir", str(tmp_path / "run2")])
        == 0
    )
    assert "cuts off" not in capsys.readouterr().out


SHAPES = [
    "--data.train",
    "data/shapes/shapes.jsonl",
    "--data.validation",
    "null",
    "--data.validation_fraction",
    "0.25",
    "--data.max_train_samples",
    "null",
]


@pytest.mark.parametrize("variant", ["lora", "vlm", "vlm-lora"])
def test_sft_phase_with_lora_and_with_images(tmp_path, tiny_lm_path, tiny_vlm_path, variant):
    """LoRA and vision-language models work in an SFT phase as in a GRPO phase; a VLM's LoRA
    adapts its language model only (the default targets)."""
    model = tiny_lm_path if variant == "lora" else tiny_vlm_path
    extra = {
        "lora": ["--model.lora", "{r: 4, alpha: 8, dropout: 0.0, target_modules: all-linear}"],
        "vlm": SHAPES,
        "vlm-lora": [*SHAPES, "--model.lora", "{r: 4, alpha: 8, dropout: 0.0}"],
    }[variant]
    phases = (
        "[{name: warm, trainer: sft, init_from: none, overrides: {training: {max_steps: 2, "
        "per_device_train_batch_size: 2, learning_rate: 1.0e-3}}}]"
    )
    argv = [
        "--config",
        "tiny.yaml",
        "--output_dir",
        str(tmp_path / "run"),
        "--model.name_or_path",
        str(model),
        "--validation.eval_steps",
        "0",
        "--validation.max_samples",
        "2",
        "--phases",
        phases,
        *extra,
    ]
    assert grpo.main(argv) == 0
    warm = tmp_path / "run" / "phase1-warm"
    rows = _training_rows(warm)
    assert len(rows) == 2 and all(torch.isfinite(torch.tensor(r["loss"])) for r in rows)
    saved = "adapter_model.safetensors" if variant.endswith("lora") else "model.safetensors"
    assert (warm / "checkpoint-1" / saved).exists() and (warm / "final" / saved).exists()
    assert [v["step"] for v in read_jsonl(warm / "validation.jsonl")] == [0, 2]
    if variant == "vlm-lora":
        from safetensors.torch import load_file

        keys = list(load_file(warm / "final" / saved))
        assert keys and all(".language_model." in k for k in keys), keys


def test_a_frozen_vision_tower_is_unchanged_after_training_steps(tmp_path, tiny_vlm_path, capsys):
    """model.vision.freeze_vision_tower in full fine-tuning: after SFT steps at a high learning
    rate the vision tower's weights are bit-identical while the projector and the language model
    moved; the run said so in its first lines, and records the setting."""
    from safetensors.torch import load_file

    phases = (
        "[{name: warm, trainer: sft, init_from: none, overrides: {training: {max_steps: 2, "
        "per_device_train_batch_size: 2, learning_rate: 1.0e-2}}}]"
    )
    argv = [
        "--config",
        "tiny.yaml",
        "--output_dir",
        str(tmp_path / "run"),
        "--model.name_or_path",
        str(tiny_vlm_path),
        "--validation.eval_steps",
        "0",
        "--validation.at_start",
        "false",
        "--validation.max_samples",
        "1",
        "--phases",
        phases,
        "--model.vision.freeze_vision_tower",
        "true",
        *SHAPES,
    ]
    assert grpo.main(argv) == 0
    assert (
        "trainable parameters: 155,232 of 203,456 (76.3%): vision tower 0 of 48,224 (frozen), projector 24,800 "
        "of 24,800, language model 130,432 of 130,432"
    ) in capsys.readouterr().out
    before = load_file(tiny_vlm_path / "model.safetensors")
    after = load_file(tmp_path / "run" / "phase1-warm" / "final" / "model.safetensors")
    # (saved under the checkpoint format's names: visual.*, visual.merger.*, model.layers.*)
    tower = [k for k in before if "visual." in k and "merger." not in k]
    moved = lambda keys: [k for k in keys if not torch.equal(before[k], after[k])]
    assert len(tower) > 10 and moved(tower) == []
    assert moved([k for k in before if "merger." in k]) and moved(
        [k for k in before if "layers." in k and "visual." not in k]
    )
    recorded = json.loads((tmp_path / "run" / "phase1-warm" / "config.json").read_text())["model"]["vision"]
    assert recorded["freeze_vision_tower"] is True and recorded["max_pixels"] == 602112

"""LoRA generation through merged adapters (train/models/lora_merge.py): same tokens, and training
bit for bit what it is without merging (identical losses, gradient norms and adapter after
several steps; base weights untouched; the saved adapter is the live, unmerged one)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback

from crystal_grpo.train import grpo
from crystal_grpo.train.config.run_config import load_config
from crystal_grpo.train.models.lora_merge import merged_adapters, merged_generate

LORA = "{r: 8, alpha: 16, dropout: 0.0, target_modules: all-linear}"


def _peft_model(path: Path):
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    cfg = LoraConfig(r=8, lora_alpha=16, target_modules="all-linear", init_lora_weights=False)  # B != 0
    return get_peft_model(AutoModelForCausalLM.from_pretrained(path), cfg).eval()


def _base_state(model) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items() if "lora_" not in k}


def test_merged_greedy_generation_equals_unmerged_and_restores_the_weights(tiny_lm_path):
    model, tok = _peft_model(tiny_lm_path), AutoTokenizer.from_pretrained(tiny_lm_path)
    ids = tok(["Tom has 3 apples and buys 4 more.", "A train leaves at 9."], return_tensors="pt", padding=True)
    before = _base_state(model)
    layer = model.base_model.model.model.layers[0].self_attn.q_proj
    pointer = layer.base_layer.weight.data_ptr()
    with torch.no_grad():
        plain_logits = model(**ids).logits
        plain = model.generate(**ids, max_new_tokens=24, do_sample=False)
        with merged_adapters(model) as merged:
            assert merged and layer.merged
            assert not torch.equal(
                layer.base_layer.weight, before["base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight"]
            ), "really merged"
            merged_logits = model(**ids).logits
            merged_ids = model.generate(**ids, max_new_tokens=24, do_sample=False)
        with model.disable_adapter():
            assert not torch.allclose(plain_logits, model(**ids).logits), "the adapter must matter"
    # fp32 rounding of W + BA against Wx + B(Ax) grows with the logits' size: relative to their scale
    scale = float(plain_logits.abs().max())
    torch.testing.assert_close(merged_logits, plain_logits, rtol=1e-5, atol=1e-5 * max(scale, 1.0))
    assert torch.equal(merged_ids, plain)
    assert not layer.merged and layer.base_layer.weight.data_ptr() == pointer
    after = _base_state(model)
    assert all(torch.equal(before[k], after[k]) for k in before), "base weights must be bit for bit restored"


def test_merging_is_off_for_plain_models_and_when_disabled(tiny_lm_path):
    plain = AutoModelForCausalLM.from_pretrained(tiny_lm_path)
    with merged_adapters(plain) as merged:
        assert not merged
    model = _peft_model(tiny_lm_path)
    with merged_adapters(model, enabled=False) as merged:
        assert not merged
    with merged_generate(model):
        assert "generate" in vars(model) and "generate_batch" in vars(model)  # continuous batching too
    assert "generate" not in vars(model) and "generate_batch" not in vars(model)


class Recorder(TrainerCallback):
    """Whether a LoRA layer ran merged, per forward (generation in no-grad, training with grad),
    and the live weights when training ends."""

    def __init__(self) -> None:
        self.calls: list[tuple[bool, bool]] = []
        self.live: dict[str, torch.Tensor] = {}

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        layer = model.base_model.model.model.layers[0].mlp.down_proj
        layer.register_forward_hook(lambda m, i, o: self.calls.append((torch.is_grad_enabled(), m.merged)))

    def on_train_end(self, args, state, control, model=None, **kwargs):
        self.live = {k: v.detach().clone() for k, v in model.state_dict().items()}


def _lora_run(tmp_path: Path, model: Path, merge: bool) -> tuple[Path, Recorder]:
    out = tmp_path / ("merged" if merge else "unmerged")
    lora = LORA.replace("}", f", merge_for_generation: {str(merge).lower()}}}")
    cfg, _ = load_config(
        "tiny.yaml",
        [
            "--model.name_or_path",
            str(model),
            "--model.lora",
            lora,
            "--reward.name",
            "answer_only",
            "--reward.params",
            "{}",
            "--training.max_steps",
            "3",
            "--training.learning_rate",
            "1e-2",
            "--training.save_steps",
            "3",
            "--validation.eval_steps",
            "3",
            "--validation.at_start",
            "false",
        ],
    )
    rec = Recorder()
    grpo.run(cfg, out, callbacks=[rec])
    return out, rec


@pytest.fixture(scope="module")
def lora_runs(tiny_lm_path, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("lora_merge")
    return {merge: _lora_run(tmp, tiny_lm_path, merge) for merge in (True, False)}


def _rows(run: Path) -> list[dict]:
    keep = ("loss", "grad_norm", "reward", "completions/mean_length", "kl")
    return [
        {k: r.get(k) for k in keep}
        for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
        if "loss" in r
    ]


def test_training_with_merged_generation_is_bit_identical(lora_runs):
    (on, rec_on), (off, rec_off) = lora_runs[True], lora_runs[False]
    # Generation (no grad) ran merged only with merging on; training forwards never did.
    assert any(not grad and merged for grad, merged in rec_on.calls)
    assert all(not merged for grad, merged in rec_on.calls if grad)
    assert not any(merged for _, merged in rec_off.calls)
    # Same sampled completions, so the same losses and gradients, step after step: exact, not
    # approximately, since training sees the very same base tensors (restored, not un-added).
    assert _rows(on) == _rows(off) and len(_rows(on)) == 3
    a = load_file(on / "final" / "adapter_model.safetensors")
    b = load_file(off / "final" / "adapter_model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert any(v.abs().max() > 0 for k, v in a.items() if "lora_B" in k), "training must move B off zero"
    val_on, val_off = ([json.loads(x) for x in (r / "validation.jsonl").read_text().splitlines()] for r in (on, off))
    assert val_on == val_off  # greedy validation: same completions through merged adapters


def test_saved_adapter_is_the_live_unmerged_one_and_the_base_is_untouched(lora_runs, tiny_lm_path):
    run, rec = lora_runs[True]
    saved = load_file(run / "checkpoint-3" / "adapter_model.safetensors")
    live = {k.replace(".default", ""): v for k, v in rec.live.items() if "lora_" in k}
    assert saved.keys() == live.keys() and all(torch.equal(saved[k], live[k]) for k in saved)
    original = load_file(tiny_lm_path / "model.safetensors")
    base = {
        k.removeprefix("base_model.model.").replace(".base_layer", ""): v
        for k, v in rec.live.items()
        if "lora_" not in k
    }
    assert set(original) <= set(base) | {"lm_head.weight"}
    assert all(torch.equal(original[k], base[k]) for k in original if k in base)

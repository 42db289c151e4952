"""The capacity plan (train/capacity/estimate.py, train/capacity/paper_plan.py): its copies of DeepSpeed's
estimators and TRL's defaults, the parameter counts it reads from config.json, its activation and
KV-cache counts against what torch really keeps, the launch it reads, and what --check prints."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from dataclasses import replace

import pytest
import torch

from crystal_grpo.train.capacity import estimate as capacity
from crystal_grpo.train.capacity.estimate import (
    QWEN25_VL_3B_CONFIG,
    Workload,
    kv_cache_bytes,
    launch_from,
    layer_activation_bytes,
    sizes_from_config,
    vision_block_bytes,
)
from crystal_grpo.train.capacity.paper_plan import meta_counts, meta_lora_params, meta_model
from crystal_grpo.train.config.training_section import TRL_DEFAULTS

SIZES = [
    (1_000, 10, 1, 1),
    (358_683_904, 4_358_144, 1, 1),
    (3_754_622_976, 311_164_928, 4, 1),
    (3_754_622_976, 311_164_928, 8, 2),
    (7_000_000_007, 500_000_001, 3, 5),
]


@pytest.mark.parametrize("total,largest,per_node,nodes", SIZES)
def test_the_estimator_copies_equal_deepspeeds(total, largest, per_node, nodes):
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

    for offload in (False, True):
        for offload_params in (False, True):
            for zero_init in (False, True):
                for factor in (1.0, 1.5):
                    kw = dict(
                        num_gpus_per_node=per_node,
                        num_nodes=nodes,
                        cpu_offload=offload,
                        cpu_offload_params=offload_params,
                        zero_init=zero_init,
                        additional_buffer_factor=factor,
                    )
                    assert capacity.zero3_model_states(total, largest, **kw) == estimate_zero3_model_states_mem_needs(
                        total, largest, **kw
                    ), kw
        kw = dict(num_gpus_per_node=per_node, num_nodes=nodes, cpu_offload=offload)
        assert capacity.zero2_model_states(total, **kw) == estimate_zero2_model_states_mem_needs(total, **kw), kw


def test_trl_defaults_are_trls():
    from trl import GRPOConfig, SFTConfig

    grpo = {f.name: f.default for f in dataclasses.fields(GRPOConfig)}
    assert {k: grpo[k] for k in TRL_DEFAULTS} == TRL_DEFAULTS
    assert {f.name: f.default for f in dataclasses.fields(SFTConfig)}["max_length"] == capacity.SFT_MAX_LENGTH


TEXT_CONFIGS = {
    "qwen2": dict(
        model_type="qwen2",
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=300,
        tie_word_embeddings=True,
    ),
    "llama": dict(
        model_type="llama",
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=1,
        vocab_size=300,
        attention_bias=True,
        mlp_bias=True,
    ),
    "mistral": dict(
        model_type="mistral",
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=3,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=300,
    ),
    "qwen3": dict(
        model_type="qwen3",
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        vocab_size=300,
        tie_word_embeddings=True,
    ),
}


def _check_counts(config: dict, lora_too: bool) -> None:
    sizes = sizes_from_config(config)
    model = meta_model(config)
    assert sizes.counts() == meta_counts(model)
    if lora_too:
        assert sizes.lora_params(16) == meta_lora_params(model, 16)


@pytest.mark.parametrize("name", sorted(TEXT_CONFIGS))
def test_parameter_counts_of_text_models(name):
    _check_counts(TEXT_CONFIGS[name], lora_too=name in ("llama", "qwen3"))


def test_parameter_counts_of_the_vlms_equal_the_meta_model(tiny_vlm_path):
    """config.json alone (what --check reads) gives the counts of the model built from it: the
    tests' tiny Qwen2.5-VL (transformers 5's nested layout) and the paper's 3B (the published flat
    one), per component, DeepSpeed's largest layer, and LoRA on the language model."""
    _check_counts(json.loads((tiny_vlm_path / "config.json").read_text()), lora_too=True)
    _check_counts(QWEN25_VL_3B_CONFIG, lora_too=True)
    assert sizes_from_config(QWEN25_VL_3B_CONFIG).total == 3_754_622_976  # the model card: "3B" (3.75B)


def test_lora_targets_of_the_plan_are_the_trainers(tiny_vlm_path):
    """The plan's LoRA count follows the trainer's targets (train/models/vision.py lora_targets, used by
    peft_config): unset on a VLM, the language model's layers only (29,933,568 trainable on the
    3B at r 16); an explicit all-linear, names or a regex as PEFT matches them on the model, the
    vision tower's and the projector's layers included."""
    paper = sizes_from_config(QWEN25_VL_3B_CONFIG)
    assert paper.lora_params(16) == 29_933_568
    parts = paper.lora_parts(16, "all-linear")
    assert parts["language"] == 29_933_568 and parts["vision"] > 0 and parts["projector"] > 0
    assert paper.lora_params(16, "all-linear") == meta_lora_params(meta_model(QWEN25_VL_3B_CONFIG), 16, "all-linear")
    config = json.loads((tiny_vlm_path / "config.json").read_text())
    sizes, model = sizes_from_config(config), meta_model(config)
    for targets in ("all-linear", ["q_proj", "qkv", "mlp.0"], r".*\.(mlp\.down_proj|attn\.proj)"):
        assert sizes.lora_params(4, targets) == meta_lora_params(model, 4, targets), targets
        assert sizes.lora_parts(4, targets)["vision"] > 0, targets
    # the vision tower counts in the activations when LoRA adapts it, not by default
    work = Workload(micro_batch=2, images=1, image_tokens=16, lora_r=4)
    everything = replace(work, lora_targets="all-linear")
    assert not capacity.vision_trains(sizes, work) and capacity.vision_trains(sizes, everything)
    assert capacity.activation_bytes(sizes, everything, True) > capacity.activation_bytes(sizes, work, True)


@pytest.mark.parametrize("bounds", [(3_136, 602_112), (28 * 28 * 16, 28 * 28 * 48), (3_136, 12_845_056)])
def test_resized_image_tokens_are_the_processors(tiny_vlm_path, bounds):
    """resized_image_tokens (what the plan counts without transformers) equals the Qwen2-VL
    processor's own count for images inside, above and below the bounds, odd aspect ratios too."""
    from crystal_grpo.train.models.loading import ModelSection, load_processing, open_source
    from crystal_grpo.train.models.vision import VisionSection, image_tokens, resized_image_tokens

    low, high = bounds
    processing = load_processing(
        open_source(ModelSection(str(tiny_vlm_path))), VisionSection(min_pixels=low, max_pixels=high)
    )
    ip = processing.image_processor
    for h, w in [(768, 1024), (336, 448), (3024, 4032), (1000, 37), (50, 90), (20, 20), (28, 28), (599, 601)]:
        expected = image_tokens(processing, h, w)
        assert resized_image_tokens(h, w, low, high, factor=ip.patch_size * ip.merge_size) == expected, (h, w)
    assert capacity.prompt_image_tokens(sizes_from_config(QWEN25_VL_3B_CONFIG), VisionSection()) == 768
    assert (
        capacity.prompt_image_tokens(sizes_from_config(QWEN25_VL_3B_CONFIG), VisionSection(max_pixels=None)) == 999
    )  # the published processor's bound


def _saved_bytes(model, run) -> int:
    """Bytes of the distinct storages autograd keeps for backward, parameters left out."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    storages: dict[int, int] = {}

    def pack(t):
        st = t.untyped_storage()
        if st.data_ptr() not in params:
            storages[st.data_ptr()] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        run()
    return sum(storages.values())


def _qwen2(layers: int, **extra):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = {**TEXT_CONFIGS["qwen2"], "hidden_size": 128, "intermediate_size": 352, "num_hidden_layers": layers, **extra}
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(
        Qwen2Config(**{k: v for k, v in cfg.items() if k != "model_type"}, attn_implementation="sdpa")
    ).to(torch.bfloat16)
    return model, sizes_from_config(cfg)


def test_activation_counts_are_what_autograd_keeps():
    """Per decoder layer and token and per vision block and patch: the plan's counts against the
    saved tensors of real bf16 models (one layer's worth: the difference between two depths).
    (LoRA dropout's extra is not checked here: on CPU dropout keeps its mask in the input's dtype,
    CUDA's fused kernel in one byte.)"""
    batch, seq = 2, 96
    ids = torch.randint(0, 300, (batch, seq))
    mask = torch.ones(batch, seq, dtype=torch.long)
    mask[0, :7] = 0  # left padding: a GRPO batch always has some

    (m2, _), (m4, sizes) = _qwen2(2), _qwen2(4)
    kept = [_saved_bytes(m, lambda m=m: m.model(input_ids=ids, attention_mask=mask)) for m in (m2, m4)]
    assert (kept[1] - kept[0]) / 2 / (batch * seq) == pytest.approx(layer_activation_bytes(sizes.text, seq), rel=0.01)

    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    def vision(depth):
        vcfg = dict(
            depth=depth,
            hidden_size=128,
            intermediate_size=352,
            num_heads=4,
            out_hidden_size=64,
            fullatt_block_indexes=[1],
        )
        cfg = Qwen2_5_VLConfig(
            text_config=dict(
                TEXT_CONFIGS["qwen2"],
                rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_section": [2, 3, 3]},
            ),
            vision_config=vcfg,
        )
        torch.manual_seed(0)
        return Qwen2_5_VLForConditionalGeneration(cfg).to(torch.bfloat16), sizes_from_config(
            {"model_type": "qwen2_5_vl", **TEXT_CONFIGS["qwen2"], "vision_config": vcfg}
        )

    grid = torch.tensor([[1, 16, 16]])
    pixels = torch.randn(256, 3 * 2 * 14 * 14, dtype=torch.bfloat16)
    (v2, _), (v4, vsizes) = vision(2), vision(4)
    kept = [_saved_bytes(m, lambda m=m: m.model.visual(pixels, grid_thw=grid)) for m in (v2, v4)]
    assert (kept[1] - kept[0]) / 2 / 256 == pytest.approx(vision_block_bytes(vsizes.vision), rel=0.01)


def test_kv_cache_is_what_generate_keeps():
    """The plan's KV cache for a generation batch is the dynamic cache ``generate`` fills (which
    holds every token but the last one generated)."""
    model, sizes = _qwen2(2, hidden_size=64, intermediate_size=96)
    model = model.float()
    sizes = dataclasses.replace(sizes, dtype_bytes=4)
    prompts, new = torch.randint(3, 300, (3, 11)), 9
    out = model.generate(
        prompts,
        attention_mask=torch.ones_like(prompts),
        max_new_tokens=new,
        min_new_tokens=new,
        do_sample=False,
        return_dict_in_generate=True,
        pad_token_id=0,
        eos_token_id=None,
    )
    kept = sum(
        t.numel() * t.element_size() for layer in out.past_key_values.layers for t in (layer.keys, layer.values)
    )
    work = Workload(micro_batch=3, generation_batch=3, prompt_tokens=11, completion_tokens=new)
    assert kept == kv_cache_bytes(sizes, work) * (11 + new - 1) // (11 + new)


def test_the_launch_comes_from_the_accelerate_config_the_launcher_or_gpus(tmp_path):
    cases = {
        "zero3_1x4.yaml": (4, 1, 3),
        "configs/accelerate/zero3_1x8.yaml": (8, 1, 3),
        "zero3_2nodes.yaml": (16, 2, 3),
        "ddp_1x4.yaml": (4, 1, 0),
        "zero2_1x4.yaml": (4, 1, 2),
    }
    for name, want in cases.items():
        launch = launch_from(name, env={})
        assert (launch.gpus, launch.nodes, launch.zero_stage) == want, name
    assert launch_from(env={}) == capacity.Launch()
    offload = {"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}}}
    (tmp_path / "ds.json").write_text(json.dumps(offload))
    env = {
        "WORLD_SIZE": "8",
        "LOCAL_WORLD_SIZE": "4",
        "ACCELERATE_USE_DEEPSPEED": "true",
        "ACCELERATE_DEEPSPEED_CONFIG_FILE": str(tmp_path / "ds.json"),
    }
    launch = launch_from(env=env)
    assert (launch.gpus, launch.nodes, launch.zero_stage, launch.offload_optimizer) == (8, 2, 3, True)
    launched = launch_from(deepspeed=str(tmp_path / "ds.json"), gpus=2, env={"WORLD_SIZE": "8"})
    assert (launched.gpus, launched.zero_stage, launched.source) == (2, 3, "--gpus")
    with pytest.raises(capacity.CapacityError, match="cannot read"):
        launch_from(str(tmp_path / "missing.yaml"), env={})


def test_a_model_without_a_reachable_config_is_not_estimated(tmp_path, monkeypatch):
    """A hub id is read from the Hugging Face cache; one that is not there, or an architecture the
    plan does not know, gives one line instead of figures."""
    from crystal_grpo.train.config.run_config import load_config

    snapshot = tmp_path / "hub" / "models--someone--cached" / "snapshots" / "abc"
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text(json.dumps(TEXT_CONFIGS["qwen3"]))
    (tmp_path / "hub" / "models--someone--cached" / "refs").mkdir()
    (tmp_path / "hub" / "models--someone--cached" / "refs" / "main").write_text("abc")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    sizes = capacity.model_sizes("someone/cached")
    assert sizes.total == sizes_from_config(TEXT_CONFIGS["qwen3"]).total and "cache" in sizes.source
    cfg, _ = load_config("cpr_curriculum", ["--model.name_or_path", "someone/not-in-the-cache"])
    assert capacity.check_lines(cfg) == [
        "memory per GPU: cannot estimate: model.name_or_path 'someone/not-in-the-cache': no config.json here (not a "
        "local folder, not in the Hugging Face cache) to read the model's sizes from"
    ]
    (tmp_path / "config.json").write_text(json.dumps({**QWEN25_VL_3B_CONFIG, "model_type": "mamba"}))
    cfg, _ = load_config("cpr_curriculum", ["--model.name_or_path", str(tmp_path)])
    assert "is not one the memory plan knows" in capacity.check_lines(cfg)[0]


def test_check_prints_the_memory_per_gpu_and_warns_when_a_phase_cannot_fit(repo_root, tmp_path):
    """--check on the paper config, launched as the paper does (4 GPUs): a line per phase, PCGrad's
    3 rows (bf16 gradient buffer, 2 micro-steps, beta 0.04) in the CPR phase's training peak; on 2
    GPUs of 40 GB a warning per phase with what would fit (optimizer offload only without PCGrad);
    without importing torch, TRL or DeepSpeed."""
    from crystal_grpo.train.config.preflight import gpu_device_nodes

    heavy = ("torch", "trl", "transformers", "deepspeed", "peft", "accelerate")
    base = [
        "--config",
        "cpr_curriculum",
        "--output_dir",
        str(tmp_path / "r"),
        "--check",
        "--accelerate_config",
        "zero3_1x4.yaml",
    ]
    base += ["--model.dtype", "float32"] if gpu_device_nodes() else []  # then the precision check asks torch
    code = (
        f"import sys; from crystal_grpo.train import grpo; base = {base!r}; "
        "[grpo.main(base + ['--gpu_memory', gib] + more) for gib, more in (('80', []), ('40', ['--gpus', '2']))]; "
        f"print('heavy:', sorted(m for m in {heavy!r} if m in sys.modules))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=repo_root, timeout=120)
    out = done.stdout.splitlines()
    assert out[-1] == "heavy: []", done.stdout + done.stderr
    heads = [i for i, line in enumerate(out) if line.startswith("memory per GPU, predicted")]
    assert len(heads) == 2 and "3.75B parameters" in out[heads[0]] and "4 GPUs, DeepSpeed ZeRO-3" in out[heads[0]]
    assert "768 image tokens (a 1024 x 768 picture at 3,136-602,112 pixels)" in out[heads[0]]
    at80, at40 = out[heads[0] : heads[1]], out[heads[1] : -1]
    assert [line.split(":")[0] for line in at80[1:3]] == ["  answer_only", "  cpr"]
    assert all("; fits in 72.0 usable" in line for line in at80[1:3]) and not any("warning" in x for x in at80)
    assert "PCGrad" not in at80[1] and "max(generation 8.2, activations 6.2 + PCGrad rows 10.5)" in at80[2]
    assert "2 GPUs" in at40[0] and all("does NOT fit in 36.0 usable" in line for line in at40[1:3])
    warnings = [line for line in at40 if line.startswith("warning:")]
    assert [w.split(":")[1] for w in warnings] == [" answer_only", " cpr"]
    assert all("does not fit in 36.0 GiB (90% of 40.0)" in w and "ZeRO-3 on 4 GPUs" in w for w in warnings)
    assert "optimizer offload" in warnings[0] and "offload" not in warnings[1]


def test_the_warning_names_what_would_fit():
    """Without gradient checkpointing the paper's CPR phase needs 98 GiB on each of 4 GPUs: a
    smaller per-device batch fits, with a group TRL accepts (it divides the 24 completions of a
    step), and so does checkpointing. Optimizer offload is offered where it fits (the answer-only
    phase on one GPU), never with PCGrad, which refuses it (the CPR phase on one GPU would fit)."""
    from crystal_grpo.train.config.run_config import load_config, phase_configs

    cfg, _ = load_config("cpr_curriculum", ["--model.gradient_checkpointing", "false"])
    lines = capacity.check_lines(cfg, "zero3_1x4.yaml", gpu_memory=80)
    warnings = [line for line in lines if line.startswith("warning:")]
    assert [w.split(":")[1] for w in warnings] == [" answer_only", " cpr"]
    assert warnings[1].endswith(
        "it would with: per_device_train_batch_size 3 with num_generations 4; gradient "
        "checkpointing; LoRA (model.lora)"
    )
    paper, _ = load_config("cpr_curriculum")
    one_gpu = [line for line in capacity.check_lines(paper, "zero3_1x1.yaml", gpu_memory=80) if "warning:" in line]
    assert [w.split(":")[1] for w in one_gpu] == [" answer_only", " cpr"]
    assert "ZeRO-3 optimizer offload to CPU" in one_gpu[0] and "offload" not in one_gpu[1]
    sizes, offload = sizes_from_config(QWEN25_VL_3B_CONFIG), capacity.Launch(zero_stage=3, offload_optimizer=True)
    cpr = capacity.workload(phase_configs(paper)[-1], sizes, offload)
    assert cpr.pcgrad and capacity.fits(capacity.plan(sizes, offload, cpr), 80 * capacity.GIB)  # but PCGrad refuses it


def test_pcgrad_rows_follow_the_config_and_the_gradient_storage():
    """The plan's PCGrad rows are pcgrad_extra_partitions of the run's accumulation steps, KL /
    entropy terms and gradient storage: DeepSpeed's buffer (bf16 under the shipped zero3.json's
    "auto" with a bf16 run; data_types.grad_accum_dtype fp32 makes it fp32, 2 bytes a parameter
    more in the model states), else the trainable parameters (LoRA's adapters fp32, PEFT's
    upcast). They count in the training phase only, not while generating."""
    from crystal_grpo.train.config.run_config import load_config, phase_configs

    sizes = sizes_from_config(QWEN25_VL_3B_CONFIG)
    fp32_buffer = {
        "zero_optimization": {"stage": 3},
        "bf16": {"enabled": "auto"},
        "data_types": {"grad_accum_dtype": "fp32"},
    }

    def work(*overrides, accelerate="zero3_1x4.yaml", deepspeed=None, phase=-1):
        cfg, _ = load_config("cpr_curriculum", list(overrides))
        launch = launch_from(accelerate, deepspeed=deepspeed, env={})
        return capacity.workload(phase_configs(cfg)[phase], sizes, launch), launch

    cases = [  # overrides, accelerate config, DeepSpeed config: rows, fp32 gradient storage
        (((), "zero3_1x4.yaml", None), (3, False)),  # the paper's: 2 micro-steps, beta 0.04, bf16 buffer
        (((), "zero3_1x4.yaml", fp32_buffer), (2, True)),
        ((("--training.beta", "0"), "zero3_1x4.yaml", None), (2, False)),
        ((("--training.beta", "0"), "zero3_1x4.yaml", fp32_buffer), (1, True)),
        ((("--training.beta", "0", "--training.entropy_coef", "0.01"), "zero3_1x4.yaml", None), (3, False)),
        ((("--training.gradient_accumulation_steps", "1"), "zero3_1x4.yaml", None), (1, False)),
        ((("--model.dtype", "float32"), "zero3_1x4.yaml", None), (2, True)),  # "auto": the run is not bf16
        ((("--training.bf16", "false"), "zero3_1x4.yaml", None), (2, True)),
        (((), None, None), (3, False)),  # one process, bf16 weights
        ((("--model.lora", "{}"), None, None), (2, True)),
        ((("--model.lora", "{}"), "zero3_1x4.yaml", None), (3, False)),
    ]
    for (overrides, accelerate, deepspeed), want in cases:
        w, _ = work(*overrides, accelerate=accelerate, deepspeed=deepspeed)
        assert (w.pcgrad_rows, w.fp32_gradients) == want, (overrides, accelerate, deepspeed)
    assert work(phase=0)[0].pcgrad_rows == 0  # answer_only: pcgrad false

    (paper, launch), (wide, _) = work(), work(deepspeed=fp32_buffer)
    m, mw = capacity.plan(sizes, launch, paper), capacity.plan(sizes, launch, wide)
    assert m.pcgrad == 4 * 3 * -(-sizes.total // 4) and mw.pcgrad == m.pcgrad * 2 // 3
    training = m.activations + m.pcgrad
    assert m.total == m.model_states + m.reference + max(m.generation, training) > training
    assert mw.model_states - m.model_states == 2 * sizes.total // 4

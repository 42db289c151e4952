"""The capacity plan of the paper's setup (``scripts/capacity_plan.py``; docs/benchmarks.md).

Qwen2.5-VL-3B is built from its published config on the meta device (no weights, no
download) to count its parameters; DeepSpeed's own estimator gives the model states; the
rest of the memory comes from ``train/capacity.py`` (what ``--check`` prints), and the step
time is predicted from the single-H100 measurements in docs/benchmarks.md. Prints markdown.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, replace

from crystal_grpo.train.capacity import (
    GIB,
    PAPER_MAX_PIXELS,
    PROMPT_TEXT_TOKENS,
    QWEN25_VL_3B_CONFIG,
    QWEN25_VL_3B_ID,
    USABLE,
    Launch,
    ModelSizes,
    Workload,
    fits,
    in_gib,
    plan,
    remedies,
    sizes_from_config,
    trainable_params,
    workload,
)
from crystal_grpo.train.config import load_config, phase_configs
from crystal_grpo.train.models import LoraSection

COMMAND = "python scripts/capacity_plan.py"


# --- parameters, counted on the model itself ------------------------------------------------
def meta_model(config: dict):
    """The model a config.json describes, built on the meta device (shapes only, no memory)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

    cfg = AutoConfig.for_model(**config)
    auto = AutoModelForImageTextToText if "vision_config" in config else AutoModelForCausalLM
    with torch.device("meta"):
        return auto.from_config(cfg)


def meta_counts(model) -> dict[str, int]:
    """Total, per component and largest-layer parameter counts of a built model.

    The largest layer is DeepSpeed's ``model_to_params`` (stage3.py): the most parameters one
    module holds itself. Its total deduplicates tied weights by ``data_ptr()``, which is 0 for
    every meta tensor; ``model.parameters()`` deduplicates them by identity instead."""
    inner = getattr(model, "model", model)
    vision = getattr(inner, "visual", None)
    part = lambda m: 0 if m is None else sum(p.numel() for p in m.parameters())  # noqa: E731
    projector = part(getattr(vision, "merger", None))
    total = part(model)
    return {"total": total, "vision": part(vision) - projector, "projector": projector,
            "language": total - part(vision),
            "largest_layer": max(sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules())}


def meta_lora_params(model, r: int) -> int:
    """Trainable parameters of peft's LoRA, all linear layers of the language model (the vision
    tower excluded, the VLM default the project moves to), r as given."""
    import torch
    from peft import LoraConfig, get_peft_model

    with torch.device("meta"):
        peft = get_peft_model(model, LoraConfig(r=r, target_modules="all-linear", exclude_modules=r".*\.visual\..*",
                                                task_type="CAUSAL_LM"))
    return sum(p.numel() for p in peft.parameters() if p.requires_grad)


# --- DeepSpeed's estimators ------------------------------------------------------------------
def deepspeed_estimators():
    """DeepSpeed's own ZeRO-3 and ZeRO-2 model-state estimators (the functions behind
    ``estimate_zero3_model_states_mem_needs_all_cold``, which only prints)."""
    import contextlib
    import io

    with contextlib.redirect_stdout(io.StringIO()):  # DeepSpeed logs its accelerator choice to stdout
        from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
        from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

    return estimate_zero3_model_states_mem_needs, estimate_zero2_model_states_mem_needs


# --- step time ---------------------------------------------------------------------------------
#: docs/benchmarks.md, "GRPO training on one GPU": on one H100, HF ``generate`` of the 24-layer
#: ``mid`` model (bf16, 16 completions, dynamic cache) took 40-60 ms per token, and generation
#: dominated the step. At such small batches a decoding step is bound by kernel launches and
#: Python, not by the GPU's arithmetic, so it is scaled by the number of decoder layers.
MEASURED_DECODE_MS = (40.0, 50.0, 60.0)
MEASURED_LAYERS = 24
#: Assumed, not measured here: the fraction of the bf16 peak the training forward/backward reaches,
#: and the bus bandwidth of NCCL's all-gather / reduce-scatter inside an NVLink node.
ASSUMED_MFU = 0.35
ASSUMED_LINK_GBPS = 230.0


@dataclass(frozen=True)
class Hardware:
    name: str
    gib: float
    bf16_tflops: float  # dense peak (NVIDIA's data sheets)
    hbm_tbps: float


A100_40 = Hardware("A100 40 GB", 40, 312, 1.555)
A100_80 = Hardware("A100 80 GB", 80, 312, 2.039)


def forward_flops(sizes: ModelSizes, work: Workload, sequences: int) -> tuple[float, float]:
    """Forward FLOPs (language model, vision tower) of ``sequences`` sequences: 2 per weight and
    token through the decoder's linear layers, causal attention (2 L q_dim s^2), the output layer
    on the scored tokens only (TRL's head), and the vision blocks on every patch."""
    t, v = sizes.text, sizes.vision
    seq = work.prompt_tokens + work.completion_tokens
    linear = t.layers * sum(i * o for i, o in t.linears().values())
    lm = sequences * (2 * linear * seq + 2 * t.layers * t.heads * t.head_dim * seq ** 2
                      + 2 * t.vocab * t.hidden * work.completion_tokens)
    vision = 0.0
    if v is not None and work.images:
        patches = sequences * work.images * work.image_tokens * v.merge ** 2
        vision = 2 * (sizes.vision_tower + sizes.projector) * patches
    return float(lm), vision


@dataclass(frozen=True)
class StepTime:
    generation: tuple[float, float, float]  # low, central, high (s)
    training: float
    communication: float

    def total(self, i: int = 1) -> float:
        return self.generation[i] + self.training + self.communication

    @property
    def generation_share(self) -> float:
        return self.generation[1] / self.total()


def step_time(sizes: ModelSizes, launch: Launch, work: Workload, hw: Hardware, accumulation: int) -> StepTime:
    """One optimizer step on each GPU (they run in parallel): generation of the generation batch
    at full completion length (an upper bound: it stops when all its completions have), then
    ``accumulation`` micro-steps of training: the policy's forward, the reference model's, and
    one backward pass per loss (three with PCGrad and a KL term), each recomputing the forward
    under gradient checkpointing; a backward pass through frozen weights costs one forward, through
    trained ones two. ZeRO-3 gathers the 16-bit weights for every forward, recompute and backward
    and for generation, and reduce-scatters the gradients; counted without overlap (upper bound)."""
    rate = hw.bf16_tflops * 1e12 * ASSUMED_MFU
    per_token = [max(ms / MEASURED_LAYERS * sizes.text.layers / 1e3, 2 * sizes.total / (hw.hbm_tbps * 1e12))
                 for ms in MEASURED_DECODE_MS]
    prefill = sum(forward_flops(sizes, replace(work, completion_tokens=0), work.generation_batch)) / rate
    generation = tuple(work.completion_tokens * t + prefill for t in per_token)
    lm, vision = forward_flops(sizes, work, work.micro_batch)
    trained_vision = 0.0 if work.lora_r else vision
    backward = (lm + trained_vision) if work.lora_r else 2 * (lm + vision)
    recompute = (lm + trained_vision) if work.checkpointing else 0.0
    passes = 2 + work.reference if work.pcgrad else 1  # PCGrad: accuracy, reasoning, and the KL term's
    flops = accumulation * ((lm + vision) * (1 + work.reference) + passes * (backward + recompute))
    comm = 0.0
    if launch.zero_stage == 3 and launch.gpus > 1:
        gathers = 1 + work.reference + passes * (1 + work.checkpointing)
        volume = accumulation * (gathers * 2 * sizes.total + passes * 2 * trainable_params(sizes, work))
        volume += 2 * sizes.total  # generation's gather
        comm = volume * (launch.gpus - 1) / launch.gpus / (ASSUMED_LINK_GBPS * 1e9)
    return StepTime(generation, flops / rate, comm)


# --- the table -------------------------------------------------------------------------------
def paper_workload(sizes: ModelSizes, config: str = "cpr_curriculum.yaml", phase: int = -1) -> tuple[Workload, int]:
    """The paper config's phase (default: the last, CPR with PCGrad) as one GPU's workload, and its
    gradient accumulation steps. (The GPU count only matters for a config that sets the global
    ``generation_batch_size``; the paper's does not.)"""
    cfg, _ = load_config(config)
    pcfg = phase_configs(cfg)[phase]
    return workload(pcfg, sizes, gpus=4), int(pcfg.training.get("gradient_accumulation_steps", 1))


def lora_variant(work: Workload) -> Workload:
    """The same workload with the project's default LoRA (model.lora: r 16, all-linear, dropout 0.05)."""
    d = LoraSection()
    return replace(work, lora_r=d.r, lora_dropout=d.dropout, lora_targets=d.target_modules,
                   lora_merged=d.merge_for_generation)


def table(sizes: ModelSizes, work: Workload, accumulation: int, estimators=None) -> list[str]:
    """Markdown rows: {LoRA, full} x {1, 2, 4, 8} GPUs x {40, 80} GB under ZeRO-3."""
    zero3, zero2 = estimators or deepspeed_estimators()
    head = ("| weights | GPUs | GPU | model states | reference | PCGrad kept + update | generation (KV cache) "
            "| activations ckpt / none | total | fits? | step s (range) | generation share |")
    rows = [head, "|" + "---|" * (head.count("|") - 1)]
    for name, wk in (("LoRA r16", lora_variant(work)), ("full", work)):
        for gpus in (1, 2, 4, 8):
            launch = Launch(gpus=gpus, zero_stage=3, source="table")
            for hw in (A100_40, A100_80):
                gpu_bytes = hw.gib * GIB
                m = plan(sizes, launch, wk, zero3, zero2, gpu_bytes=gpu_bytes)
                ok = fits(m, gpu_bytes)
                verdict = "yes" if ok else "no: " + ("; ".join(remedies(sizes, launch, wk, gpu_bytes)) or "-")
                st = step_time(sizes, launch, wk, hw, accumulation)
                rows.append(
                    f"| {name} | {gpus} | {hw.name} | {in_gib(m.model_states)} | {in_gib(m.reference)} | "
                    f"{in_gib(m.pcgrad)} + {in_gib(m.pcgrad_update)} | {in_gib(m.generation)} ({in_gib(m.kv_cache)}) | "
                    f"{in_gib(m.activations_ckpt)} / {in_gib(m.activations_full)} | {in_gib(m.total)} | {verdict} | "
                    f"{st.total():.0f} ({st.total(0):.0f}-{st.total(2):.0f}) | {st.generation_share:.0%} |")
    return rows


#: docs/benchmarks.md, "GRPO training on one GPU": peak ``torch.cuda.max_memory_allocated`` (GiB) on
#: one H100 of ``mid`` (a Qwen2.5-0.5B-shaped Qwen2, scripts/make_tiny_models.py build_mid_lm), bf16,
#: 2 prompts x 8 completions of at most 256 tokens a step, no gradient checkpointing (tiny.yaml),
#: beta 0.04, LoRA r 16 without dropout (merged for generation in the plain-lora figure).
MID_CONFIG = {"model_type": "qwen2", "hidden_size": 896, "num_hidden_layers": 24, "num_attention_heads": 14,
              "num_key_value_heads": 2, "intermediate_size": 4864, "vocab_size": 877, "tie_word_embeddings": True}
MID_MEASURED_GIB = {"plain-full": "10.28-11.10", "plain-lora": "14.02", "zero3-full": "22.83",
                    "zero3-full-pcgrad": "26.86", "zero3-lora": "15.49"}
#: data/wordproblems prompts rendered with the project tokenizer: 139-187 tokens (median 160).
MID_PROMPT_TOKENS = 170
#: The longest completion of a step in those runs (80-150 tokens), and the limit.
MID_COMPLETIONS = (150, 256)


def measured_check(estimators=None) -> list[str]:
    """Markdown rows: the plan's prediction for the runs measured on one H100, beside the measurement."""
    zero3, zero2 = estimators or deepspeed_estimators()
    sizes = sizes_from_config(MID_CONFIG, "mid", "bfloat16")
    rows = ["| setting | measured peak | predicted, completions of 150 / 256 tokens | at 256: states + reference + "
            "PCGrad + max(generation, activations) |", "|---|---|---|---|"]
    for name, measured in MID_MEASURED_GIB.items():
        launcher, weights, *rest = name.split("-")
        launch = Launch(zero_stage=3 if launcher == "zero3" else 0, source="one H100")
        work = Workload(micro_batch=16, generation_batch=16, prompt_tokens=MID_PROMPT_TOKENS, checkpointing=False,
                        reference=weights == "full", pcgrad=rest == ["pcgrad"], lora_r=16 if weights == "lora" else 0)
        low, high = (plan(sizes, launch, replace(work, completion_tokens=c), zero3, zero2) for c in MID_COMPLETIONS)
        parts = " + ".join(in_gib(x) for x in (high.model_states, high.reference, high.pcgrad))
        rows.append(f"| {name} | {measured} | {in_gib(low.total)} / {in_gib(high.total)} | {parts} + "
                    f"max({in_gib(high.generation)}, {in_gib(high.activations)}) |")
    return rows


def parameter_lines(sizes: ModelSizes, counts: dict[str, int], lora_meta: int, r: int) -> list[str]:
    same = counts == sizes.counts() and lora_meta == sizes.lora_params(r)
    return [
        f"{QWEN25_VL_3B_ID}, built on the meta device from its published config.json "
        f"(config-only count of train/capacity.py: {'identical' if same else 'DIFFERENT'}):",
        "",
        "| part | parameters |",
        "|---|---|",
        f"| total | {counts['total']:,} |",
        f"| vision tower | {counts['vision']:,} |",
        f"| projector (patch merger) | {counts['projector']:,} |",
        f"| language model (tied embedding / output layer) | {counts['language']:,} |",
        f"| largest layer (DeepSpeed's largest_layer_params: the embedding) | {counts['largest_layer']:,} |",
        f"| LoRA r {r}, all linear layers of the language model | {lora_meta:,} |",
    ]


def _on(flag: bool) -> str:
    return "on" if flag else "off"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="cpr_curriculum.yaml", help="the run config whose last phase is planned")
    args = ap.parse_args(argv)
    model = meta_model(QWEN25_VL_3B_CONFIG)
    sizes = sizes_from_config(QWEN25_VL_3B_CONFIG, QWEN25_VL_3B_ID, "bfloat16")
    r = LoraSection().r
    counts, lora_meta = meta_counts(model), meta_lora_params(model, r)
    work, accumulation = paper_workload(sizes, args.config)
    lines = [f"`{COMMAND}" + (f" --config {args.config}`" if args.config != "cpr_curriculum.yaml" else "`"), ""]
    lines += parameter_lines(sizes, counts, lora_meta, r)
    lines += ["", f"Per GPU, GiB; ZeRO-3; {args.config}'s last phase: {work.micro_batch} completions a micro-step, "
              f"{work.generation_batch} generated at once, prompts of {PROMPT_TEXT_TOKENS} text + {work.image_tokens} "
              f"image tokens (max_pixels {PAPER_MAX_PIXELS:,}), {work.completion_tokens}-token completions, "
              f"gradient checkpointing {_on(work.checkpointing)}, PCGrad {_on(work.pcgrad)}, reference model "
              f"{_on(work.reference)}; fits: total <= {USABLE:.0%} of the GPU.", ""]
    estimators = deepspeed_estimators()
    lines += table(sizes, work, accumulation, estimators)
    phase1, _ = paper_workload(sizes, args.config, phase=0)
    if phase1 != work:
        lines += ["", f"The first phase ({'PCGrad on' if phase1.pcgrad else 'no PCGrad'}), the same columns:", ""]
        lines += table(sizes, phase1, accumulation, estimators)
    lines += ["", "The plan against the peaks measured on one H100 (docs/benchmarks.md, `mid` model), GiB:", ""]
    lines += measured_check(estimators)
    print("\n".join(lines))
    return 0

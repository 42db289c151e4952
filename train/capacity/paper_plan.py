"""The capacity plan of the paper's setup (``scripts/capacity_plan.py``; docs/benchmarks.md).

Qwen2.5-VL-3B is built from its published config on the meta device (no weights, no
download) to count its parameters; DeepSpeed's own estimator gives the model states; the
rest of the memory comes from ``train/capacity/estimate.py`` (what ``--check`` prints), and the step
time is predicted from the single-H100 measurements in docs/benchmarks.md. Prints markdown.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, replace

from crystal_grpo.train.capacity.estimate import (
    ASSUMED_IMAGE,
    GIB,
    PROMPT_TEXT_TOKENS,
    QWEN25_VL_3B_CONFIG,
    QWEN25_VL_3B_ID,
    USABLE,
    Launch,
    ModelSizes,
    Targets,
    Workload,
    fits,
    in_gib,
    launch_from,
    pixel_bounds,
    plan,
    remedies,
    sizes_from_config,
    trainable_params,
    vision_trains,
    workload,
)
from crystal_grpo.train.config.run_config import load_config, phase_configs
from crystal_grpo.train.models.loading import LoraSection, ModelSection, peft_config
from crystal_grpo.train.models.vision import VisionSection, resized_image_tokens
from crystal_grpo.train.pcgrad.memory import pcgrad_extra_partitions

COMMAND = "python scripts/capacity_plan.py"
DEFAULT_CONFIG = "cpr_curriculum.yaml"


def command(config: str, *flags: str) -> str:
    """The command line that prints this, in backquotes."""
    return "`" + " ".join((COMMAND, *flags, *(("--config", config) if config != DEFAULT_CONFIG else ()))) + "`"


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
    part = lambda m: 0 if m is None else sum(p.numel() for p in m.parameters())
    projector = part(getattr(vision, "merger", None))
    total = part(model)
    return {
        "total": total,
        "vision": part(vision) - projector,
        "projector": projector,
        "language": total - part(vision),
        "largest_layer": max(sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules()),
    }


def meta_lora_params(model, r: int, target_modules: Targets = None) -> int:
    """Trainable parameters of peft's LoRA as the trainer configures it (``train/models/loading.py``
    ``peft_config``) for this ``model.lora.target_modules`` (unset: the language model's linear
    layers), r as given. Wraps a deep copy: PEFT injects its layers into the model it is given."""
    import copy

    import torch
    from peft import get_peft_model

    model = copy.deepcopy(model)
    lora = LoraSection(r=r, target_modules=target_modules)
    with torch.device("meta"):
        peft = get_peft_model(model, peft_config(ModelSection("meta", lora=lora), model))
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
    lm = sequences * (
        2 * linear * seq
        + 2 * t.layers * t.heads * t.head_dim * seq**2
        + 2 * t.vocab * t.hidden * work.completion_tokens
    )
    vision = 0.0
    if v is not None and work.images:
        patches = sequences * work.images * work.image_tokens * v.merge**2
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
    per_token = [
        max(ms / MEASURED_LAYERS * sizes.text.layers / 1e3, 2 * sizes.total / (hw.hbm_tbps * 1e12))
        for ms in MEASURED_DECODE_MS
    ]
    prefill = sum(forward_flops(sizes, replace(work, completion_tokens=0), work.generation_batch)) / rate
    generation = tuple(work.completion_tokens * t + prefill for t in per_token)
    lm, vision = forward_flops(sizes, work, work.micro_batch)
    trained_vision = vision if vision_trains(sizes, work) else 0.0
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
#: The paper's launch (CRYSTAL S8.2: 4 x A100 80 GB, DeepSpeed ZeRO-3): its DeepSpeed config decides
#: the gradient buffer's dtype, hence PCGrad's rows, for every GPU count of the table.
PAPER_LAUNCH = "zero3_1x4.yaml"


def paper_workloads(
    sizes: ModelSizes, config: str = DEFAULT_CONFIG, phase: int = -1
) -> tuple[dict[str, Workload], int]:
    """The config's phase (default: the last, CPR with PCGrad) as one GPU's workload under the
    paper's launch, in full fine-tuning and with the project's default LoRA (``model.lora: {}``),
    each built by ``train/capacity/estimate.py``'s ``workload`` from the config as ``--check`` builds it;
    and its gradient accumulation steps. (The GPU count only matters for a config that sets the
    global ``generation_batch_size``; the paper's does not.)"""
    launch = launch_from(PAPER_LAUNCH, env={})
    out = {}
    for lora in ("{}", "null"):
        cfg, _ = load_config(config, ["--model.lora", lora])
        pcfg = phase_configs(cfg)[phase]
        work = workload(pcfg, sizes, launch)
        out[f"LoRA r{work.lora_r}" if work.lora_r else "full"] = work
    return out, int(pcfg.training.get("gradient_accumulation_steps", 1))


def table(sizes: ModelSizes, works: dict[str, Workload], accumulation: int, estimators=None) -> list[str]:
    """Markdown rows: {LoRA, full} x {1, 2, 4, 8} GPUs x {40, 80} GB under ZeRO-3."""
    zero3, zero2 = estimators or deepspeed_estimators()
    head = (
        "| weights | GPUs | GPU | model states | reference | PCGrad rows | generation (KV cache) "
        "| activations ckpt / none | total | fits? | step s (range) | generation share |"
    )
    rows = [head, "|" + "---|" * (head.count("|") - 1)]
    for name, wk in works.items():
        for gpus in (1, 2, 4, 8):
            launch = Launch(gpus=gpus, zero_stage=3, source="table")
            for hw in (A100_40, A100_80):
                gpu_bytes = hw.gib * GIB
                m = plan(sizes, launch, wk, zero3, zero2, gpu_bytes=gpu_bytes)
                ok = fits(m, gpu_bytes)
                verdict = "yes" if ok else "no: " + ("; ".join(remedies(sizes, launch, wk, gpu_bytes)) or "-")
                st = step_time(sizes, launch, wk, hw, accumulation)
                pcgrad = f"{in_gib(m.pcgrad)} ({wk.pcgrad_rows})" if wk.pcgrad else "-"
                rows.append(
                    f"| {name} | {gpus} | {hw.name} | {in_gib(m.model_states)} | {in_gib(m.reference)} | "
                    f"{pcgrad} | {in_gib(m.generation)} ({in_gib(m.kv_cache)}) | "
                    f"{in_gib(m.activations_ckpt)} / {in_gib(m.activations_full)} | {in_gib(m.total)} | {verdict} | "
                    f"{st.total():.0f} ({st.total(0):.0f}-{st.total(2):.0f}) | {st.generation_share:.0%} |"
                )
    return rows


#: docs/benchmarks.md, "GRPO training on one GPU": peak ``torch.cuda.max_memory_allocated`` (GiB) on
#: one H100 of ``mid`` (a Qwen2.5-0.5B-shaped Qwen2, scripts/make_tiny_models.py build_mid_lm), bf16,
#: 2 prompts x 8 completions of at most 256 tokens a step, no gradient checkpointing (tiny.yaml),
#: beta 0.04, LoRA r 16 without dropout (merged for generation in the plain-lora figure); one micro-step
#: a step (tiny.yaml), so PCGrad's rows are one whatever the gradients' dtype. The PCGrad run was measured
#: with PCGrad's first implementation (3 rows all run, up to 3 more at the update); the plan counts today's.
MID_CONFIG = {
    "model_type": "qwen2",
    "hidden_size": 896,
    "num_hidden_layers": 24,
    "num_attention_heads": 14,
    "num_key_value_heads": 2,
    "intermediate_size": 4864,
    "vocab_size": 877,
    "tie_word_embeddings": True,
}
MID_MEASURED_GIB = {
    "plain-full": "10.28-11.10",
    "plain-lora": "14.02",
    "zero3-full": "22.83",
    "zero3-full-pcgrad": "26.86",
    "zero3-lora": "15.49",
}
#: data/wordproblems prompts rendered with the project tokenizer: 139-187 tokens (median 160).
MID_PROMPT_TOKENS = 170
#: The longest completion of a step in those runs (80-150 tokens), and the limit.
MID_COMPLETIONS = (150, 256)
MID_ACCUMULATION, MID_BETA = 1, 0.04


def measured_check(estimators=None) -> list[str]:
    """Markdown rows: the plan's prediction for the runs measured on one H100, beside the measurement."""
    zero3, zero2 = estimators or deepspeed_estimators()
    sizes = sizes_from_config(MID_CONFIG, "mid", "bfloat16")
    rows = [
        "| setting | measured peak | predicted, completions of 150 / 256 tokens | at 256: states + reference + "
        "max(generation, activations + PCGrad rows) |",
        "|---|---|---|---|",
    ]
    for name, measured in MID_MEASURED_GIB.items():
        launcher, weights, *rest = name.split("-")
        launch = Launch(zero_stage=3 if launcher == "zero3" else 0, source="one H100")
        pcgrad = rest == ["pcgrad"]
        work = Workload(
            micro_batch=16,
            generation_batch=16,
            prompt_tokens=MID_PROMPT_TOKENS,
            checkpointing=False,
            reference=weights == "full",
            lora_r=16 if weights == "lora" else 0,
            pcgrad=pcgrad,
            pcgrad_rows=pcgrad_extra_partitions(MID_ACCUMULATION, MID_BETA) if pcgrad else 0,
        )
        low, high = (plan(sizes, launch, replace(work, completion_tokens=c), zero3, zero2) for c in MID_COMPLETIONS)
        rows.append(
            f"| {name} | {measured} | {in_gib(low.total)} / {in_gib(high.total)} | "
            f"{in_gib(high.model_states)} + {in_gib(high.reference)} + max({in_gib(high.generation)}, "
            f"{in_gib(high.activations)} + {in_gib(high.pcgrad)}) |"
        )
    return rows


def parameter_lines(sizes: ModelSizes, counts: dict[str, int], lora_meta: dict[Targets, int], r: int) -> list[str]:
    """``lora_meta``: PEFT's count on the meta model per ``model.lora.target_modules`` setting."""
    same = counts == sizes.counts() and all(n == sizes.lora_params(r, t) for t, n in lora_meta.items())
    return [
        f"{QWEN25_VL_3B_ID}, built on the meta device from its published config.json "
        f"(config-only count of train/capacity/estimate.py: {'identical' if same else 'DIFFERENT'}):",
        "",
        "| part | parameters |",
        "|---|---|",
        f"| total | {counts['total']:,} |",
        f"| vision tower | {counts['vision']:,} |",
        f"| projector (patch merger) | {counts['projector']:,} |",
        f"| language model (tied embedding / output layer) | {counts['language']:,} |",
        f"| largest layer (DeepSpeed's largest_layer_params: the embedding) | {counts['largest_layer']:,} |",
        f"| LoRA r {r}, the default targets: every linear layer of the language model | {lora_meta[None]:,} |",
        f"| LoRA r {r}, `target_modules: all-linear`: the vision tower's and the projector's too "
        f"| {lora_meta['all-linear']:,} |",
    ]


#: Images for ``--vision``, (height, width): the plan's, a VGA picture, a 12-megapixel phone photo,
#: and two below the smallest bound.
VISION_IMAGES = (ASSUMED_IMAGE, (480, 640), (3024, 4032), (40, 60), (20, 20))


def vision_lines(config: str) -> list[str]:
    """Image tokens per image under the config's ``model.vision`` bounds, the defaults (the paper's,
    CRYSTAL S8.2) and the published processor's (``null``), by ``train/models/vision.py``'s
    ``resized_image_tokens`` (tested against the Qwen2-VL processor)."""
    cfg, _ = load_config(config)
    columns: dict[tuple[int, int], list[str]] = {}  # the config's bounds are often the defaults: one column
    for name, v in (
        (config, cfg.model.vision),
        ("the defaults (the paper's)", VisionSection()),
        ("null (the published processor's)", VisionSection(max_pixels=None, min_pixels=None)),
    ):
        columns.setdefault(pixel_bounds(v), []).append(name)
    head = "| image (width x height) | " + " | ".join(
        f"{' = '.join(n)}: {lo:,}-{hi:,} pixels" for (lo, hi), n in columns.items()
    )
    rows = [head + " |", "|" + "---|" * (len(columns) + 1)]
    for h, w in VISION_IMAGES:
        tokens = [resized_image_tokens(h, w, lo, hi) for lo, hi in columns]
        rows.append(
            f"| {w} x {h}{' (the plan' + chr(39) + 's)' if (h, w) == ASSUMED_IMAGE else ''} | "
            + " | ".join(f"{t:,}" for t in tokens)
            + " |"
        )
    return [
        command(config, "--vision"),
        "",
        "Image tokens per image (Qwen2-VL-family processors: 28 x 28 pixels a token after resizing into the bounds):",
        "",
    ] + rows


def _on(flag: bool) -> str:
    return "on" if flag else "off"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default=DEFAULT_CONFIG, help="the run config whose last phase is planned")
    ap.add_argument(
        "--vision",
        action="store_true",
        help="only print the image tokens per image under the "
        "config's model.vision bounds, the defaults and the published processor's",
    )
    args = ap.parse_args(argv)
    if args.vision:
        print("\n".join(vision_lines(args.config)))
        return 0
    model = meta_model(QWEN25_VL_3B_CONFIG)
    sizes = sizes_from_config(QWEN25_VL_3B_CONFIG, QWEN25_VL_3B_ID, "bfloat16")
    r = LoraSection().r
    counts = meta_counts(model)
    lora_meta = {t: meta_lora_params(model, r, t) for t in (None, "all-linear")}
    works, accumulation = paper_workloads(sizes, args.config)
    work = works["full"]
    cfg, _ = load_config(args.config)
    launch = launch_from(PAPER_LAUNCH, env={})
    low, high = pixel_bounds(cfg.model.vision)
    lines = [command(args.config), ""]
    lines += parameter_lines(sizes, counts, lora_meta, r)
    lines += [
        "",
        f"Per GPU, GiB; ZeRO-3 ({PAPER_LAUNCH}'s DeepSpeed config, gradient buffer {launch.gradient_dtype}: "
        f"{'fp32' if work.fp32_gradients else '16-bit'} in this run); {args.config}'s last phase: "
        f"{work.micro_batch} completions a micro-step, {accumulation} micro-steps an update, "
        f"{work.generation_batch} generated at once, prompts of {PROMPT_TEXT_TOKENS} text + {work.image_tokens} "
        f"image tokens (a {ASSUMED_IMAGE[1]} x {ASSUMED_IMAGE[0]} picture at model.vision's "
        f"{low:,}-{high:,} pixels), {work.completion_tokens}-token completions, "
        f"gradient checkpointing {_on(work.checkpointing)}, PCGrad {_on(work.pcgrad)} "
        f"({work.pcgrad_rows} fp32 rows), reference model {_on(work.reference)}; "
        f"fits: total <= {USABLE:.0%} of the GPU.",
        "",
    ]
    estimators = deepspeed_estimators()
    lines += table(sizes, works, accumulation, estimators)
    phase1, _ = paper_workloads(sizes, args.config, phase=0)
    if phase1 != works:
        lines += [
            "",
            f"The first phase ({'PCGrad on' if phase1['full'].pcgrad else 'no PCGrad'}), the same columns:",
            "",
        ]
        lines += table(sizes, phase1, accumulation, estimators)
    lines += ["", "The plan against the peaks measured on one H100 (docs/benchmarks.md, `mid` model), GiB:", ""]
    lines += measured_check(estimators)
    print("\n".join(lines))
    return 0

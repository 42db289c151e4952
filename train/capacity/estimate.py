"""Memory per GPU of a run, predicted from the model's sizes alone (docs/benchmarks.md, "Capacity plan").

``train/grpo.py --check`` prints one line per phase from here, and warns when a phase cannot
fit; ``scripts/capacity_plan.py`` (``train/capacity/paper_plan.py``) prints the table for the
paper's model. Nothing here imports torch, TRL or DeepSpeed, so ``--check`` stays fast. The
model's sizes come from its ``config.json``; model states are DeepSpeed's own estimate, copied
line for line (:func:`zero3_model_states`); the rest is counted from the code that allocates it.
How each part is counted: docs/benchmarks.md, "Capacity plan". All figures are bytes per GPU; a
phase fits when its peak is within ``USABLE`` of the GPU's memory.
"""

from __future__ import annotations

import json
import os
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Union

from crystal_grpo.errors import CrystalError
from crystal_grpo.train.config.training_section import TRL_DEFAULTS
from crystal_grpo.train.models.vision import PUBLISHED_QWEN_PIXELS, lora_targets, resized_image_tokens
from crystal_grpo.train.pcgrad.memory import pcgrad_extra_partitions

GIB = 2**30
#: Share of a GPU's memory a run may plan for.
USABLE = 0.9
#: What a GPU holds when torch cannot be asked (no GPU on this machine): an A100 / H100 80 GB.
DEFAULT_GPU_GIB = 80.0

#: The paper's model (CRYSTAL S8.2).
QWEN25_VL_3B_ID = "Qwen/Qwen2.5-VL-3B-Instruct"
#: Its config.json as published on the model card (huggingface.co/Qwen/Qwen2.5-VL-3B-Instruct,
#: file config.json; transformers 4.x's flat layout, which Qwen2_5_VLConfig still reads).
QWEN25_VL_3B_CONFIG: dict[str, Any] = {
    "architectures": ["Qwen2_5_VLForConditionalGeneration"],
    "attention_dropout": 0.0,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
    "vision_start_token_id": 151652,
    "vision_end_token_id": 151653,
    "vision_token_id": 151654,
    "image_token_id": 151655,
    "video_token_id": 151656,
    "hidden_act": "silu",
    "hidden_size": 2048,
    "initializer_range": 0.02,
    "intermediate_size": 11008,
    "max_position_embeddings": 128000,
    "max_window_layers": 70,
    "model_type": "qwen2_5_vl",
    "num_attention_heads": 16,
    "num_hidden_layers": 36,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-06,
    "rope_theta": 1000000.0,
    "sliding_window": 32768,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.41.2",
    "use_cache": True,
    "use_sliding_window": False,
    "vision_config": {
        "depth": 32,
        "hidden_act": "silu",
        "hidden_size": 1280,
        "intermediate_size": 3420,
        "num_heads": 16,
        "in_chans": 3,
        "out_hidden_size": 2048,
        "patch_size": 14,
        "spatial_merge_size": 2,
        "spatial_patch_size": 14,
        "window_size": 112,
        "fullatt_block_indexes": [7, 15, 23, 31],
        "tokens_per_second": 2,
        "temporal_patch_size": 2,
    },
    "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]},
    "vocab_size": 151936,
}
#: The image of a prompt the plan assumes, (height, width) in pixels: TextVQA's photos (Open Images,
#: typically 1,024 pixels on the long side), the larger of the paper's two data sets' images. Its
#: tokens follow the run's ``model.vision`` bounds: 768 at the defaults, the paper's 3,136-602,112
#: pixels (S8.2; any image of 602,112 pixels or more comes out at 768), 999 at the published
#: processor's 12,845,056 (``max_pixels: null``), where a 12-megapixel photo would cost 15,552.
ASSUMED_IMAGE = (768, 1024)
#: Prompt text, assumed: the system instruction (about 70 tokens), the chat template, the question
#: and its options.
PROMPT_TEXT_TOKENS = 256

SFT_MAX_LENGTH = 1024  # SFTConfig.max_length
#: model_type -> how its decoder layer differs from Qwen2's (q/k/v bias, o bias, MLP bias, q/k norms).
TEXT_MODEL_TYPES = {
    "qwen2": {},
    "qwen2_5_vl": {},
    "qwen2_5_vl_text": {},
    "llama": {"bias_from": "attention_bias"},
    "mistral": {"bias_from": None},
    "qwen3": {"bias_from": "attention_bias", "qk_norm": True},
}


#: ``model.lora.target_modules`` as the config gives it: None (the default), a regex, ``all-linear``,
#: or module names.
Targets = Union[str, tuple[str, ...], list[str], None]


class CapacityError(CrystalError, ValueError):
    """The model's sizes cannot be read (no config.json reachable, or an unknown architecture)."""


# --- model sizes from config.json -----------------------------------------------------
@dataclass(frozen=True)
class TextShape:
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    tied: bool
    qkv_bias: bool = True
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False

    def linears(self) -> dict[str, tuple[int, int]]:
        """(in, out) of each linear layer of one decoder layer, by module name."""
        h, q, kv, i = self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim, self.intermediate
        return {
            "q_proj": (h, q),
            "k_proj": (h, kv),
            "v_proj": (h, kv),
            "o_proj": (q, h),
            "gate_proj": (h, i),
            "up_proj": (h, i),
            "down_proj": (i, h),
        }

    def layer_modules(self) -> list[int]:
        """Parameters held directly by each module of one decoder layer."""
        bias = {
            "q_proj": self.qkv_bias,
            "k_proj": self.qkv_bias,
            "v_proj": self.qkv_bias,
            "o_proj": self.o_bias,
            "gate_proj": self.mlp_bias,
            "up_proj": self.mlp_bias,
            "down_proj": self.mlp_bias,
        }
        out = [i * o + (o if bias[name] else 0) for name, (i, o) in self.linears().items()]
        return out + [self.hidden, self.hidden] + ([self.head_dim] * 2 if self.qk_norm else [])


@dataclass(frozen=True)
class VisionShape:
    """Qwen2.5-VL's vision tower (windowed ViT, SwiGLU MLP, RMSNorm) and its patch merger."""

    depth: int
    hidden: int
    intermediate: int
    heads: int
    in_channels: int
    patch: int
    temporal_patch: int
    merge: int
    out_hidden: int

    def block_modules(self) -> list[int]:
        h, i = self.hidden, self.intermediate
        return [h, h, 3 * h * h + 3 * h, h * h + h, h * i + i, h * i + i, i * h + h]  # norms, qkv, proj, MLP

    def block_linears(self) -> dict[str, tuple[int, int]]:
        """(in, out) of each linear layer of one vision block, by module path within the block."""
        h, i = self.hidden, self.intermediate
        return {
            "attn.qkv": (h, 3 * h),
            "attn.proj": (h, h),
            "mlp.gate_proj": (h, i),
            "mlp.up_proj": (h, i),
            "mlp.down_proj": (i, h),
        }

    def merger_modules(self) -> list[int]:
        m = self.hidden * self.merge**2
        return [self.hidden, m * m + m, m * self.out_hidden + self.out_hidden]

    def merger_linears(self) -> dict[str, tuple[int, int]]:
        m = self.hidden * self.merge**2
        return {"mlp.0": (m, m), "mlp.2": (m, self.out_hidden)}

    @property
    def patch_embed(self) -> int:
        return self.in_channels * self.temporal_patch * self.patch**2 * self.hidden


@dataclass(frozen=True)
class ModelSizes:
    """Parameter counts (as the model built from the config has them) and the shapes the plan needs."""

    text: TextShape
    vision: Union[VisionShape, None]
    dtype_bytes: int
    source: str

    @property
    def language(self) -> int:
        t = self.text
        head = 0 if t.tied else t.vocab * t.hidden
        return t.vocab * t.hidden + t.layers * sum(t.layer_modules()) + t.hidden + head

    @property
    def vision_tower(self) -> int:
        v = self.vision
        return 0 if v is None else v.patch_embed + v.depth * sum(v.block_modules())

    @property
    def projector(self) -> int:
        return 0 if self.vision is None else sum(self.vision.merger_modules())

    @property
    def total(self) -> int:
        return self.language + self.vision_tower + self.projector

    @property
    def largest_layer(self) -> int:
        """DeepSpeed's ``largest_layer_params``: the most parameters one module holds itself
        (``model_to_params``: a tied output layer counts again, as a module of its own)."""
        sizes = [self.text.vocab * self.text.hidden, *self.text.layer_modules()]
        if self.vision is not None:
            sizes += [self.vision.patch_embed, *self.vision.block_modules(), *self.vision.merger_modules()]
        return max(sizes)

    def counts(self) -> dict[str, int]:
        """Parameters per component, as ``train/capacity/paper_plan.py meta_counts`` finds them on the model."""
        return {
            "total": self.total,
            "vision": self.vision_tower,
            "projector": self.projector,
            "language": self.language,
            "largest_layer": self.largest_layer,
        }

    def linear_layers(self) -> dict[str, tuple[str, int, int]]:
        """Every linear layer but the output one (what PEFT's ``all-linear`` adapts): module path,
        as transformers 5 names it, -> (part, in, out); part is language, vision or projector."""
        t, v = self.text, self.vision
        prefix = "model.language_model." if v is not None else "model."
        block = lambda name: "self_attn" if name in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
        out = {
            f"{prefix}layers.{n}.{block(name)}.{name}": ("language", i, o)
            for n in range(t.layers)
            for name, (i, o) in t.linears().items()
        }
        if v is not None:
            out.update(
                {
                    f"model.visual.blocks.{n}.{name}": ("vision", i, o)
                    for n in range(v.depth)
                    for name, (i, o) in v.block_linears().items()
                }
            )
            out.update(
                {f"model.visual.merger.{name}": ("projector", i, o) for name, (i, o) in v.merger_linears().items()}
            )
        return out

    def lora_layers(self, target_modules: Targets = None) -> dict[str, tuple[str, int, int]]:
        """The linear layers LoRA adapts for a ``model.lora.target_modules`` setting, by the
        trainer's rule (``train/models/vision.py``'s ``lora_targets``; unset on a VLM: its language model's
        only), matched as PEFT matches them: a string is a regex it full-matches (``all-linear``:
        every layer here), a list names modules by their last components."""
        targets, language_only = lora_targets(target_modules, self.vision is not None)

        def adapted(path: str) -> bool:
            if targets == "all-linear":
                return True
            if isinstance(targets, str):
                return re.fullmatch(targets, path) is not None
            return any(path == t or path.endswith("." + t) for t in targets)

        return {
            path: layer
            for path, layer in self.linear_layers().items()
            if adapted(path) and (layer[0] == "language" or not language_only)
        }

    def lora_parts(self, r: int, target_modules: Targets = None) -> dict[str, int]:
        """LoRA's trainable parameters per part (language, vision, projector): r x (in + out) a layer."""
        out = dict.fromkeys(("language", "vision", "projector"), 0)
        for part, i, o in self.lora_layers(target_modules).values():
            out[part] += r * (i + o)
        return out

    def lora_params(self, r: int, target_modules: Targets = None) -> int:
        return sum(self.lora_parts(r, target_modules).values())

    def adapted_weights(self, target_modules: Targets = None) -> int:
        """Base weights of the adapted layers (what a merged copy for generation holds)."""
        return sum(i * o for _, i, o in self.lora_layers(target_modules).values())


_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def sizes_from_config(config: dict[str, Any], source: str = "config.json", dtype: str = "auto") -> ModelSizes:
    """The sizes of the model a ``config.json`` describes (transformers 4.x flat or 5.x nested layout)."""
    model_type = config.get("model_type")
    text = {**config, **(config.get("text_config") or {})}
    text_type = text.get("model_type", model_type)
    if model_type not in TEXT_MODEL_TYPES or text_type not in TEXT_MODEL_TYPES:
        raise CapacityError(
            f"{source}: model_type {model_type!r} is not one the memory plan knows "
            f"({', '.join(sorted(TEXT_MODEL_TYPES))})"
        )
    kind = TEXT_MODEL_TYPES[model_type]
    bias = text.get(kind["bias_from"], False) if "bias_from" in kind else None
    h, heads = int(text["hidden_size"]), int(text["num_attention_heads"])
    shape = TextShape(
        layers=int(text["num_hidden_layers"]),
        hidden=h,
        heads=heads,
        kv_heads=int(text.get("num_key_value_heads") or heads),
        head_dim=int(text.get("head_dim") or h // heads),
        intermediate=int(text["intermediate_size"]),
        vocab=int(text["vocab_size"]),
        tied=bool(config.get("tie_word_embeddings") or text.get("tie_word_embeddings")),
        qkv_bias=True if bias is None else bool(bias),
        o_bias=bool(bias),
        mlp_bias=bool(text.get("mlp_bias", False)),
        qk_norm=bool(kind.get("qk_norm")),
    )
    vision = None
    if "vision_config" in config:
        v = config["vision_config"]
        vision = VisionShape(
            depth=int(v.get("depth", 32)),
            hidden=int(v.get("hidden_size", 3584)),
            intermediate=int(v.get("intermediate_size", 3420)),
            heads=int(v.get("num_heads", 16)),
            in_channels=int(v.get("in_channels", v.get("in_chans", 3))),
            patch=int(v.get("patch_size", 14)),
            temporal_patch=int(v.get("temporal_patch_size", 2)),
            merge=int(v.get("spatial_merge_size", 2)),
            out_hidden=int(v.get("out_hidden_size", 3584)),
        )
    if dtype == "auto":
        dtype = str(config.get("dtype") or config.get("torch_dtype") or text.get("dtype") or "float32")
    return ModelSizes(shape, vision, _DTYPE_BYTES.get(dtype, 4), source)


def model_sizes(name_or_path: str, gguf_file: Union[str, None] = None, dtype: str = "auto") -> ModelSizes:
    """Sizes of ``model.name_or_path`` from its config.json: a local folder, the Hugging Face
    cache, or the published config of the paper's model. :class:`CapacityError` otherwise."""
    if gguf_file:
        raise CapacityError(f"model.gguf_file {gguf_file!r}: a GGUF model has no config.json to size it from")
    path = Path(os.path.expanduser(name_or_path)) / "config.json"
    source = str(path)
    if not path.is_file():
        cached = _hub_cached_config(name_or_path)
        if cached is None and name_or_path == QWEN25_VL_3B_ID:
            return sizes_from_config(QWEN25_VL_3B_CONFIG, f"{QWEN25_VL_3B_ID}'s published config.json", dtype)
        if cached is None:
            raise CapacityError(
                f"model.name_or_path {name_or_path!r}: no config.json here (not a local folder, "
                "not in the Hugging Face cache) to read the model's sizes from"
            )
        path, source = Path(cached), f"{name_or_path} (Hugging Face cache)"
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise CapacityError(f"{path}: unreadable ({err})") from None
    return sizes_from_config(config, source, dtype)


def _hub_cached_config(repo_id: str) -> Union[str, None]:
    """The cached config.json of a hub id, or None. huggingface_hub (slow to import) is only
    asked when the repository has a folder in one of the cache's places."""
    if repo_id.startswith((".", "/", "~")) or repo_id.count("/") != 1:
        return None
    env = os.environ
    home = env.get("HF_HOME") or os.path.join(env.get("XDG_CACHE_HOME") or "~/.cache", "huggingface")
    roots = [env.get("HF_HUB_CACHE"), env.get("HUGGINGFACE_HUB_CACHE"), os.path.join(home, "hub")]
    folder = "models--" + repo_id.replace("/", "--")
    for root in (Path(os.path.expanduser(r)) for r in roots if r):
        if (root / folder).is_dir():
            from huggingface_hub import try_to_load_from_cache

            try:
                found = try_to_load_from_cache(repo_id, "config.json", cache_dir=root)
            except ValueError:
                return None
            return found if isinstance(found, str) else None
    return None


# --- DeepSpeed's estimators, copied (tests/test_capacity.py compares them with DeepSpeed's) ----
def zero3_model_states(
    total_params: int,
    largest_layer_params: int,
    num_gpus_per_node: int = 1,
    num_nodes: int = 1,
    cpu_offload: bool = True,
    cpu_offload_params: bool = True,
    zero_init: bool = True,
    additional_buffer_factor: float = 1.5,
) -> tuple[int, int, int]:
    """``deepspeed.runtime.zero.stage3.estimate_zero3_model_states_mem_needs`` (DeepSpeed 0.19):
    (CPU bytes, GPU bytes, largest layer's bytes) for params, gradients and Adam states."""
    total_gpus = num_nodes * num_gpus_per_node
    gpus_factor = 1 / num_nodes
    largest_layer_memory = 4 * largest_layer_params
    if cpu_offload:
        if cpu_offload_params:
            gpu_mem = largest_layer_memory
            if zero_init:
                cpu_mem = total_params * 18 * gpus_factor * additional_buffer_factor
            else:
                cpu_mem = total_params * max(4 * num_gpus_per_node, 18 * gpus_factor) * additional_buffer_factor
        else:
            gpu_mem = largest_layer_memory + int(2 * total_params / total_gpus)
            if zero_init:
                cpu_mem = total_params * 16 * gpus_factor * additional_buffer_factor
            else:
                cpu_mem = total_params * max(4 * num_gpus_per_node, 16 * gpus_factor) * additional_buffer_factor
    else:
        gpu_mem = largest_layer_memory + int(18 * total_params / total_gpus)
        if zero_init:
            cpu_mem = largest_layer_params * 4 * num_gpus_per_node * additional_buffer_factor
        else:
            cpu_mem = total_params * 4 * num_gpus_per_node * additional_buffer_factor
    return int(cpu_mem), int(gpu_mem), largest_layer_memory


def zero2_model_states(
    total_params: int,
    num_gpus_per_node: int = 1,
    num_nodes: int = 1,
    cpu_offload: bool = True,
    additional_buffer_factor: float = 1.5,
) -> tuple[int, int]:
    """``deepspeed.runtime.zero.stage_1_and_2.estimate_zero2_model_states_mem_needs`` (DeepSpeed 0.19)."""
    total_gpus = num_nodes * num_gpus_per_node
    if cpu_offload:
        gpu_mem = 2 * total_params
        cpu_mem = total_params * max(4 * total_gpus, 16) * additional_buffer_factor
    else:
        gpu_mem = 2 * total_params + int(18 * total_params / total_gpus)
        cpu_mem = total_params * 4 * num_gpus_per_node * additional_buffer_factor
    return int(cpu_mem), int(gpu_mem)


# --- the launch: GPUs and sharding ----------------------------------------------------------
@dataclass(frozen=True)
class Launch:
    """How a run is spread: processes (one GPU each), DeepSpeed ZeRO stage (0: none) and offload."""

    gpus: int = 1
    nodes: int = 1
    zero_stage: int = 0
    offload_optimizer: bool = False
    offload_params: bool = False
    #: DeepSpeed's gradient buffer: fp32, bf16, fp16, or auto (the run's precision: :func:`fp32_gradient_storage`)
    gradient_dtype: str = "auto"
    source: str = "one process: --accelerate_config FILE or --gpus N for another launch"

    def describe(self) -> str:
        sharding = (
            f"DeepSpeed ZeRO-{self.zero_stage}" if self.zero_stage else "DDP" if self.gpus > 1 else "no DeepSpeed"
        )
        offload = [n for n, on in (("optimizer", self.offload_optimizer), ("params", self.offload_params)) if on]
        return (
            f"{self.gpus} GPU{'s' if self.gpus > 1 else ''}, {sharding}"
            + (f" with {' and '.join(offload)} offload" if offload else "")
            + f" ({self.source})"
        )


def _resolve(path: str, *folders: Path) -> Path:
    p = Path(os.path.expanduser(path))
    for base in (Path.cwd(), *folders):
        if (base / p).is_file():
            return base / p
    return p


def _deepspeed_settings(ds: Union[dict, str, None], folders: tuple[Path, ...] = ()) -> dict[str, Any]:
    """ZeRO stage and offload from a DeepSpeed config (a dict, or a JSON file)."""
    if isinstance(ds, str):
        try:
            ds = json.loads(_resolve(ds, *folders).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return {}
    ds = ds or {}
    zero = ds.get("zero_optimization") or {}
    device = lambda key: (zero.get(key) or {}).get("device", "none") not in ("none", None)
    out = {
        "offload_optimizer": device("offload_optimizer"),
        "offload_params": device("offload_param"),
        "gradient_dtype": _gradient_dtype(ds),
    }
    if "stage" in zero:
        out["zero_stage"] = int(zero["stage"])
    return out


#: DeepSpeed's names of a dtype (its ``DtypeEnum``), as :func:`_gradient_dtype` gives them.
_DEEPSPEED_DTYPES = {
    "fp32": ("fp32", "float32", "float", "torch.float32"),
    "fp16": ("fp16", "float16", "half", "torch.float16"),
    "bf16": ("bf16", "bfloat16", "torch.bfloat16"),
}


def _gradient_dtype(ds: dict) -> str:
    """DeepSpeed's gradient buffer dtype (``DeepSpeedEngine.get_data_types``):
    ``data_types.grad_accum_dtype``, else the precision it trains in (``bf16``/``fp16`` enabled;
    ``auto``, which transformers fills from the run's ``bf16``/``fp16``), else fp32."""
    explicit = str((ds.get("data_types") or {}).get("grad_accum_dtype") or "").lower()
    for name, spellings in _DEEPSPEED_DTYPES.items():
        if explicit in spellings:
            return name
    for key in ("bf16", "fp16"):
        enabled = (ds.get(key) or {}).get("enabled", False)
        if enabled == "auto":
            return "auto"
        if enabled is True or str(enabled).lower() == "true":
            return key
    return "fp32"


def launch_from(
    accelerate_config: Union[str, None] = None,
    deepspeed: Union[dict, str, None] = None,
    gpus: Union[int, None] = None,
    env: Union[dict, None] = None,
) -> Launch:
    """The launch a run gets: ``--gpus`` wins, then the launcher's WORLD_SIZE, then an accelerate
    config file's ``num_processes``; the ZeRO stage from ``training.deepspeed``, else the accelerate
    config's DeepSpeed config (the file or its own keys), else what ``accelerate launch`` exported."""
    from crystal_grpo.train.config.run_config import CONFIG_DIR

    env = os.environ if env is None else env
    settings: dict[str, Any] = {}
    count, nodes, source = 1, 1, Launch.source
    if accelerate_config:
        from crystal_grpo.train.config.run_config import parse_yaml

        path = _resolve(accelerate_config, CONFIG_DIR / "accelerate", CONFIG_DIR.parent)
        try:
            acc = parse_yaml(path.read_text(encoding="utf-8"), str(path)) or {}
        except OSError as err:
            raise CapacityError(f"--accelerate_config: cannot read {path} ({err})") from None
        count, nodes, source = (
            int(acc.get("num_processes", 1)),
            int(acc.get("num_machines", 1)),
            str(accelerate_config),
        )
        if acc.get("distributed_type") == "DEEPSPEED":
            dsc = acc.get("deepspeed_config") or {}
            if dsc.get("deepspeed_config_file"):
                settings = _deepspeed_settings(str(dsc["deepspeed_config_file"]), (CONFIG_DIR.parent,))
            else:
                settings = {
                    "zero_stage": int(dsc.get("zero_stage", 0)),
                    "offload_optimizer": dsc.get("offload_optimizer_device", "none") != "none",
                    "offload_params": dsc.get("offload_param_device", "none") != "none",
                }
    elif int(env.get("WORLD_SIZE", "1")) > 1:
        count, source = int(env["WORLD_SIZE"]), "the launcher's WORLD_SIZE"
        nodes = max(1, count // int(env.get("LOCAL_WORLD_SIZE", count)))
    if deepspeed:
        settings = {**settings, **_deepspeed_settings(deepspeed)}
    elif not settings and str(env.get("ACCELERATE_USE_DEEPSPEED", "")).lower() == "true":
        settings = (
            _deepspeed_settings(env.get("ACCELERATE_DEEPSPEED_CONFIG_FILE"))
            if env.get("ACCELERATE_DEEPSPEED_CONFIG_FILE")
            else {"zero_stage": int(env.get("ACCELERATE_DEEPSPEED_ZERO_STAGE", 0))}
        )
    if gpus:
        count, source = gpus, "--gpus"
    return Launch(gpus=count, nodes=nodes, source=source, **settings)


# --- what one GPU holds ----------------------------------------------------------------------
@dataclass(frozen=True)
class Workload:
    """What one phase does on each GPU."""

    micro_batch: int  # sequences per forward/backward (per_device_train_batch_size)
    generation_batch: int = 0  # sequences generated at once (x steps_per_generation); 0: no generation
    num_generations: int = 0  # completions per prompt (TRL: divides the global generation batch)
    prompt_tokens: int = PROMPT_TEXT_TOKENS  # text + image tokens of one prompt
    completion_tokens: int = 512  # generated (GRPO) or target (SFT) tokens
    images: int = 0  # images per sequence
    image_tokens: int = 0  # merged tokens per image
    checkpointing: bool = True
    lora_r: int = 0  # 0: full fine-tuning
    lora_targets: Targets = None  # model.lora.target_modules (None: the default, ModelSizes.lora_layers)
    lora_dropout: float = 0.0
    lora_merged: bool = True  # LoRA generates through a merged copy (train/models/lora_merge.py)
    reference: bool = False  # TRL's reference model (beta > 0, full fine-tuning)
    pcgrad: bool = False
    pcgrad_rows: int = 0  # PCGrad's fp32 rows of the trainable partition (pcgrad_extra_partitions)
    fp32_gradients: bool = False  # the gradient storage is fp32 (DeepSpeed: its gradient buffer)
    gather_for_generation: bool = True  # TRL's ds3_gather_for_generation
    vllm_share: float = 0.0  # vLLM colocated: its share of the GPU


@dataclass(frozen=True)
class Memory:
    """Bytes per GPU; the peak is what is always there plus the larger of the two phases of a
    step: generation, and training (the forward/backward, with PCGrad's rows alive from an
    update's first backward pass to its optimizer step)."""

    model_states: int
    reference: int
    pcgrad: int  # PCGrad's fp32 rows, while training (none while generating)
    generation: int  # gathered or merged weights + KV cache + prefill, while generating
    kv_cache: int
    activations: int  # the training forward/backward with the configured checkpointing
    activations_ckpt: int
    activations_full: int
    vllm: int = 0

    @property
    def total(self) -> int:
        return self.model_states + self.reference + self.vllm + max(self.generation, self.training)

    @property
    def training(self) -> int:
        return self.activations + self.pcgrad


Estimator = Callable[..., tuple]


def trainable_params(sizes: ModelSizes, work: Workload) -> int:
    return sizes.lora_params(work.lora_r, work.lora_targets) if work.lora_r else sizes.total


def vision_trains(sizes: ModelSizes, work: Workload) -> bool:
    """Whether the vision tower has trainable weights (full fine-tuning, or LoRA adapting it)."""
    if sizes.vision is None:
        return False
    return not work.lora_r or sizes.lora_parts(work.lora_r, work.lora_targets)["vision"] > 0


def model_states_bytes(
    sizes: ModelSizes,
    launch: Launch,
    work: Workload,
    zero3: Estimator = zero3_model_states,
    zero2: Estimator = zero2_model_states,
) -> int:
    """Weights, gradients and optimizer state on one GPU. Under DeepSpeed: DeepSpeed's estimate for
    the trainable parameters (16-bit weights and gradients, fp32 master weights and Adam moments,
    18 bytes each, partitioned; a gathered layer at 4 bytes a parameter) plus, for LoRA, the frozen
    base weights' partition (ZeRO-3) or copy (ZeRO-2); DeepSpeed counts 16-bit gradients, so an
    fp32 gradient buffer on a 16-bit model (``data_types.grad_accum_dtype: fp32``) adds 2 bytes
    a trainable parameter of the partition. Without DeepSpeed: weights, gradients and torch's
    AdamW moments, all in the model's dtype, on every GPU (plus DDP's gradient buckets with
    several GPUs)."""
    trainable, w = trainable_params(sizes, work), sizes.dtype_bytes
    frozen = sizes.total - trainable if work.lora_r else 0
    per_node = launch.gpus // launch.nodes
    wide = 2 * trainable if work.fp32_gradients and w == 2 else 0
    if launch.zero_stage == 3:
        _, gpu, _ = zero3(
            trainable,
            sizes.largest_layer,
            num_gpus_per_node=per_node,
            num_nodes=launch.nodes,
            cpu_offload=launch.offload_optimizer,
            cpu_offload_params=launch.offload_params,
        )
        return gpu + (0 if launch.offload_params else w * frozen // launch.gpus) + wide // launch.gpus
    if launch.zero_stage in (1, 2):
        _, gpu = zero2(
            trainable, num_gpus_per_node=per_node, num_nodes=launch.nodes, cpu_offload=launch.offload_optimizer
        )
        return gpu + w * frozen + wide // launch.gpus
    return w * (sizes.total + trainable * (3 + (launch.gpus > 1)))


def kv_cache_bytes(sizes: ModelSizes, work: Workload) -> int:
    """HF generate's KV cache at full length: every layer keeps K and V (kv_heads x head_dim, in the
    model's dtype) of each prompt and generated token; the dynamic cache grows to it, a static one
    starts there."""
    t = sizes.text
    per_token = t.layers * 2 * t.kv_heads * t.head_dim * sizes.dtype_bytes
    return work.generation_batch * (work.prompt_tokens + work.completion_tokens) * per_token


def layer_activation_bytes(t: TextShape, seq: int) -> int:
    """Bytes autograd keeps per token for one decoder layer's backward (16-bit activations).

    Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer Models",
    section 4.1) count 34 h + 5 a s bytes per token and layer for GPT (dropout, GeLU MLP of 4h,
    softmax kept). For a Qwen2 / Qwen2.5-VL layer under SDPA with a padding mask (the
    memory-efficient kernel keeps no s x s scores; K and V repeated to all heads), no dropout,
    a SwiGLU MLP of width I and RMSNorm computed in fp32: each norm 8h (its fp32 input, the
    normalised input of the weight, its output), q, k, v and the attention output 8h, the
    log-sum-exp 4a, the mask 2s, the MLP 8I (gate, up, act(gate), their product):
    24h + 8I + 4a + 2s. tests/test_capacity.py checks it against what autograd saves."""
    return 24 * t.hidden + 8 * t.intermediate + 4 * t.heads + 2 * seq


def vision_block_bytes(v: VisionShape) -> int:
    """The same per patch for a Qwen2.5-VL vision block: norms 16h, q and k after the rotary
    embedding, the fused qkv output (v is a view of it) and the attention output per window and
    joined, 14h, the log-sum-exp 4a and the MLP 8I: 30h + 8I + 4a (tests/test_capacity.py)."""
    return 30 * v.hidden + 8 * v.intermediate + 4 * v.heads


#: LoRA with dropout keeps, per element of an adapted layer's input, the dropout mask (1 byte in
#: CUDA's fused kernel) and the dropped 16-bit input its first matrix needs (fp32 adapters, PEFT's
#: default, get the 16-bit copy autocast makes); without dropout that input is the layer's own.
LORA_DROPOUT_BYTES = 3


def activation_bytes(sizes: ModelSizes, work: Workload, checkpointing: bool) -> int:
    """Training forward/backward memory of ``micro_batch`` sequences (16-bit activations; a
    float32 model keeps twice as much): every decoder layer (:func:`layer_activation_bytes`) and
    the final norm (6h); with gradient checkpointing (HF checkpoints every decoder and vision
    block) a layer keeps only its input (2h) and one layer is recomputed at a time. LoRA adds
    :data:`LORA_DROPOUT_BYTES` per input element of each adapted layer. The vision tower counts
    when it trains (full fine-tuning, or LoRA adapting it; frozen it records nothing): its blocks
    (:func:`vision_block_bytes`) and about one block more for the patch embedding and the merger.
    Then TRL's chunked log-prob head (trl/kernels/chunked_logprob.py: the [N, V] logits never
    exist): the hidden states it keeps (2h per scored token), a 4,096 x 32,768 16-bit tile, fp32
    and 16-bit gradients of the hidden states and, when the output layer trains, of its weight (6 V h)."""
    t, v = sizes.text, sizes.vision
    seq = work.prompt_tokens + work.completion_tokens
    tokens = work.micro_batch * seq
    dropout = dict.fromkeys(("language", "vision", "projector"), 0)  # LoRA dropout's bytes, per token a layer
    if work.lora_r and work.lora_dropout > 0:
        for part, i, _ in sizes.lora_layers(work.lora_targets).values():
            dropout[part] += LORA_DROPOUT_BYTES * i
    per_layer = layer_activation_bytes(t, seq) + dropout["language"] // t.layers
    kept = 2 * t.hidden if checkpointing else per_layer
    lm = tokens * (t.layers * kept + (per_layer if checkpointing else 0) + 6 * t.hidden)
    vision = 0
    if v is not None and vision_trains(sizes, work) and work.images:
        patches = work.micro_batch * work.images * work.image_tokens * v.merge**2
        block = vision_block_bytes(v) + dropout["vision"] // v.depth
        vision = patches * ((v.depth * 2 * v.hidden + block) if checkpointing else (v.depth + 1) * block)
    scored = work.micro_batch * work.completion_tokens
    head = scored * t.hidden * (2 + 6) + min(scored, 4096) * min(t.vocab, 32768) * 2
    if not work.lora_r:
        head += 6 * t.vocab * t.hidden
    return (lm + vision + head) * sizes.dtype_bytes // 2


def generation_bytes(sizes: ModelSizes, launch: Launch, work: Workload) -> int:
    """While generating: the weights TRL gathers under ZeRO-3 (all of them,
    ``ds3_gather_for_generation``), or LoRA's merged copy of the adapted weights (not under
    ZeRO-3: the gathered weights are merged in place), the KV cache, and the prefill's largest
    transient (one MLP's gate, up and product over the prompts)."""
    if not work.generation_batch or work.vllm_share:
        return 0
    weights = 0
    if launch.zero_stage == 3 and work.gather_for_generation:
        weights = sizes.dtype_bytes * sizes.total
    elif work.lora_r and work.lora_merged:
        weights = sizes.dtype_bytes * sizes.adapted_weights(work.lora_targets)
    prefill = work.generation_batch * work.prompt_tokens * 3 * sizes.text.intermediate * sizes.dtype_bytes
    return weights + kv_cache_bytes(sizes, work) + prefill


def plan(
    sizes: ModelSizes,
    launch: Launch,
    work: Workload,
    zero3: Estimator = zero3_model_states,
    zero2: Estimator = zero2_model_states,
    gpu_bytes: float = DEFAULT_GPU_GIB * GIB,
) -> Memory:
    """The memory one GPU needs for ``work`` under ``launch`` (``zero3``/``zero2``: DeepSpeed's
    estimators or the copies above; ``gpu_bytes`` only sizes a colocated vLLM)."""
    ref = 0
    if work.reference and not work.lora_r:  # LoRA: TRL's reference is the base with adapters off
        ref = sizes.dtype_bytes * sizes.total // (launch.gpus if launch.zero_stage == 3 else 1)
    trainable = trainable_params(sizes, work)
    local = -(-trainable // launch.gpus) if launch.zero_stage == 3 else trainable
    ckpt, full = activation_bytes(sizes, work, True), activation_bytes(sizes, work, False)
    return Memory(
        model_states=model_states_bytes(sizes, launch, work, zero3, zero2),
        reference=ref,
        pcgrad=4 * work.pcgrad_rows * local if work.pcgrad else 0,
        generation=generation_bytes(sizes, launch, work),
        kv_cache=kv_cache_bytes(sizes, work) if work.generation_batch else 0,
        activations=ckpt if work.checkpointing else full,
        activations_ckpt=ckpt,
        activations_full=full,
        vllm=int(work.vllm_share * gpu_bytes),
    )


def fits(memory: Memory, gpu_bytes: float) -> bool:
    return memory.total <= USABLE * gpu_bytes


# --- a run config's phases ----------------------------------------------------------------
def pixel_bounds(vision) -> tuple[int, int]:
    """(min_pixels, max_pixels) a run's processor applies: ``model.vision``'s, the published
    processor's (:data:`PUBLISHED_QWEN_PIXELS`) where one is null."""
    return tuple(
        own if own is not None else published
        for own, published in zip((vision.min_pixels, vision.max_pixels), PUBLISHED_QWEN_PIXELS)
    )


def prompt_image_tokens(sizes: ModelSizes, vision) -> int:
    """Tokens of :data:`ASSUMED_IMAGE` under a run's ``model.vision`` bounds, resized as the
    Qwen2-VL processor resizes it; 0 for a text model."""
    if sizes.vision is None:
        return 0
    low, high = pixel_bounds(vision)
    return resized_image_tokens(
        *ASSUMED_IMAGE, min_pixels=low, max_pixels=high, factor=sizes.vision.patch * sizes.vision.merge
    )


def fp32_gradient_storage(cfg, sizes: ModelSizes, launch: Launch) -> bool:
    """Whether the gradient storage PCGrad reads is fp32, which decides its rows the way
    ``train/pcgrad/gradients.py``'s ``open_window`` does at run time (from the storage's dtype):
    under DeepSpeed its gradient buffer (:func:`_gradient_dtype`; ``auto`` is the run's
    ``bf16``/``fp16``, ``RunConfig.precision``), else the trainable parameters: LoRA's adapters
    in fp32 (PEFT upcasts 16-bit ones outside ZeRO-3), full fine-tuning in the model's dtype."""
    if launch.zero_stage:
        dtype = launch.gradient_dtype
        if dtype == "auto":
            precision = cfg.precision()
            dtype = "bf16" if precision["bf16"] else "fp16" if precision["fp16"] else "fp32"
        return dtype == "fp32"
    return cfg.model.lora is not None or sizes.dtype_bytes == 4


def workload(cfg, sizes: ModelSizes, launch: Launch) -> Workload:
    """What one phase (a RunConfig) does on each GPU; TRL's defaults where its ``training`` is silent."""
    from crystal_grpo.train.config.run_config import PaperRecipe

    tr = {**TRL_DEFAULTS, **cfg.training}
    per_device = int(tr["per_device_train_batch_size"])
    accumulation = int(tr["gradient_accumulation_steps"])
    lora = cfg.model.lora
    image_tokens = prompt_image_tokens(sizes, cfg.model.vision)
    fp32 = fp32_gradient_storage(cfg, sizes, launch)
    common = dict(
        micro_batch=per_device,
        images=int(sizes.vision is not None),
        image_tokens=image_tokens,
        prompt_tokens=PROMPT_TEXT_TOKENS + image_tokens,
        checkpointing=bool(cfg.training.get("gradient_checkpointing", cfg.model.gradient_checkpointing)),
        lora_r=lora.r if lora else 0,
        lora_dropout=lora.dropout if lora else 0.0,
        lora_targets=lora.target_modules if lora else None,
        lora_merged=bool(lora and lora.merge_for_generation),
        fp32_gradients=fp32,
    )
    if cfg.trainer == "sft":
        target = int(tr.get("max_length") or SFT_MAX_LENGTH) - common["prompt_tokens"]
        return Workload(**common, completion_tokens=max(target, 0))
    steps = tr["steps_per_generation"] or accumulation
    gen = int(tr["generation_batch_size"]) // launch.gpus if tr["generation_batch_size"] else per_device * int(steps)
    vllm = float(tr["vllm_gpu_memory_utilization"]) if tr["use_vllm"] and tr["vllm_mode"] == "colocate" else 0.0
    beta = float(tr.get("beta", PaperRecipe.beta))
    entropy = float(tr["entropy_coef"]) != 0 or bool(tr["use_adaptive_entropy"])
    # aux_loss: the architectures the plan knows (TEXT_MODEL_TYPES) have no router
    rows = pcgrad_extra_partitions(accumulation, beta, entropy_bonus=entropy, fp32_gradients=fp32) if cfg.pcgrad else 0
    return Workload(
        **common,
        generation_batch=gen,
        num_generations=int(tr["num_generations"] or 0),
        completion_tokens=int(tr["max_completion_length"]),
        reference=beta > 0,
        pcgrad=bool(cfg.pcgrad),
        pcgrad_rows=rows,
        gather_for_generation=bool(tr["ds3_gather_for_generation"]),
        vllm_share=vllm,
    )


def gpu_memory_bytes(option_gib: Union[float, None]) -> tuple[float, str]:
    """The GPU's memory: the option, else what torch reports for GPU 0 when torch is already
    loaded (the precision check loads it for a bf16/fp16 config where a GPU device node exists;
    ``--check`` never loads it for this alone), else an 80 GB card."""
    if option_gib:
        return option_gib * GIB, f"{option_gib:g} GiB (--gpu_memory)"
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        return float(props.total_memory), f"{props.total_memory / GIB:.0f} GiB ({props.name})"
    return DEFAULT_GPU_GIB * GIB, f"{DEFAULT_GPU_GIB:g} GiB (assumed; --gpu_memory GIB to change)"


def in_gib(n: float) -> str:
    """Bytes as GiB, one decimal."""
    return f"{n / GIB:.1f}"


def describe(memory: Memory, usable: float) -> str:
    """``41.2 GiB = model states 18.1 + ... ; fits`` (GiB)."""
    parts = [f"model states {in_gib(memory.model_states)}"]
    parts += [f"reference model {in_gib(memory.reference)}"] if memory.reference else []
    parts += [f"vLLM {in_gib(memory.vllm)}"] if memory.vllm else []
    peak = [f"generation {in_gib(memory.generation)}"] if memory.generation else []
    peak += [
        f"activations {in_gib(memory.activations)}"
        + (f" + PCGrad rows {in_gib(memory.pcgrad)}" if memory.pcgrad else "")
    ]
    verdict = "fits" if memory.total <= usable else "does NOT fit"
    return (
        f"{in_gib(memory.total)} GiB = {' + '.join(parts)} + max({', '.join(peak)}); {verdict} in "
        f"{in_gib(usable)} usable"
    )


def remedies(sizes: ModelSizes, launch: Launch, work: Workload, gpu_bytes: float) -> list[str]:
    """Changes that make a phase that does not fit, fit (the first of each kind that does)."""
    from crystal_grpo.train.models.loading import LoraSection

    out = []
    ok = lambda ln, wk: fits(plan(sizes, ln, wk, gpu_bytes=gpu_bytes), gpu_bytes)
    zero3 = replace(launch, zero_stage=3) if launch.zero_stage != 3 else launch
    for n in (2, 4, 8, 16, 32, 64):
        if n > launch.gpus and ok(replace(zero3, gpus=n, nodes=max(1, n // 8)), work):
            out.append(f"ZeRO-3 on {n} GPUs")
            break
    if not work.pcgrad and not launch.offload_optimizer and ok(replace(zero3, offload_optimizer=True), work):
        out.append("ZeRO-3 optimizer offload to CPU")
    for b in range(work.micro_batch - 1, 0, -1):
        smaller = replace(work, micro_batch=b, generation_batch=work.generation_batch * b // work.micro_batch)
        group = _group(smaller, launch.gpus)
        if group is not None and ok(launch, smaller):
            out.append(f"per_device_train_batch_size {b}{group}")
            break
    if not work.checkpointing and ok(launch, replace(work, checkpointing=True)):
        out.append("gradient checkpointing")
    lora = LoraSection()
    if not work.lora_r and ok(launch, replace(work, lora_r=lora.r, lora_dropout=lora.dropout)):
        out.append("LoRA (model.lora)")
    return out


def _group(work: Workload, gpus: int) -> Union[str, None]:
    """`` with num_generations g`` when TRL needs a smaller group for this batch (the global
    generation batch must be a multiple of it, g >= 2), "" when the group can stay, None when no
    group fits."""
    total, g = work.generation_batch * gpus, work.num_generations
    if not g or not total or total % g == 0:
        return ""
    smaller = [d for d in range(2, g) if total % d == 0]
    return f" with num_generations {smaller[-1]}" if smaller else None


def check_lines(
    cfg,
    accelerate_config: Union[str, None] = None,
    gpus: Union[int, None] = None,
    gpu_memory: Union[float, None] = None,
) -> list[str]:
    """What ``--check`` prints: one line per phase with its predicted memory per GPU, and a
    ``warning:`` line for each phase that cannot fit (with what would make it fit). Nothing for
    a CPU run."""
    from crystal_grpo.train.config.run_config import phase_configs

    if cfg.training.get("use_cpu") or cfg.cpu_backend:
        return []
    try:
        sizes = model_sizes(cfg.model.name_or_path, cfg.model.gguf_file, cfg.model.dtype)
        launch = launch_from(accelerate_config, cfg.training.get("deepspeed"), gpus)
    except CapacityError as err:
        return [f"memory per GPU: cannot estimate: {err}"]
    gpu_bytes, gpu_text = gpu_memory_bytes(gpu_memory)
    usable = USABLE * gpu_bytes
    image = ""
    if sizes.vision:
        low, high = pixel_bounds(cfg.model.vision)
        image = (
            f" + {prompt_image_tokens(sizes, cfg.model.vision)} image tokens (a {ASSUMED_IMAGE[1]} x "
            f"{ASSUMED_IMAGE[0]} picture at {low:,}-{high:,} pixels)"
        )
    lines = [
        f"memory per GPU, predicted (docs/benchmarks.md, capacity plan): {sizes.total / 1e9:.2f}B parameters "
        f"({sizes.source}); {launch.describe()}; GPU {gpu_text}; prompts of {PROMPT_TEXT_TOKENS} text"
        f"{image or ' tokens'}, completions at full length"
    ]
    warnings = []
    names = [p.name for p in cfg.phases] or ["run"]
    for name, phase in zip(names, phase_configs(cfg)):
        work = workload(phase, sizes, launch)
        memory = plan(sizes, launch, work, gpu_bytes=gpu_bytes)
        lines.append(f"  {name}: {describe(memory, usable)}")
        if not fits(memory, gpu_bytes):
            fix = remedies(sizes, launch, work, gpu_bytes)
            warnings.append(
                f"warning: {name}: predicted {in_gib(memory.total)} GiB per GPU does not fit in "
                f"{in_gib(usable)} GiB ({USABLE:.0%} of {in_gib(gpu_bytes)})"
                + (f"; it would with: {'; '.join(fix)}" if fix else "; no single change makes it fit")
            )
    return lines + warnings

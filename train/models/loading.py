"""Loading the policy model and its processing class for the trainer.

``load_policy(model_cfg)`` returns ``(model, processing_class)`` for causal LMs,
vision-language models (with a real processor) and GGUF files, without PEFT wrapping (TRL's
``peft_config`` wraps it). Every load, the policy's, a checkpoint's (evaluation) and export's,
goes through :func:`open_source`, :func:`load_processing` and :func:`load_weights`. What each
kind of model needs and why: docs/training.md, "Loading models".

``ModelSection`` (the ``model:`` section of a run config) is defined here, beside the code
that reads it (its ``vision`` part in train/models/vision.py).
"""

from __future__ import annotations

import copy
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Union

from crystal_grpo.errors import CrystalError
from crystal_grpo.jsonl import read_json
from crystal_grpo.train.models.vision import (
    VisionSection,
    freeze_parts,
    is_vision_language,
    language_lora_target,
    lora_targets,
    set_image_resolution,
)
from crystal_grpo.typed import from_dict, option

logger = logging.getLogger(__name__)

#: model_type -> needs remote code. Original InternVL checkpoints ship their modeling code.
REMOTE_CODE_MODEL_TYPES = {"internvl_chat": "InternVL"}
_DTYPES = ("float32", "bfloat16", "float16", "auto")


class ModelLoadError(CrystalError, RuntimeError):
    """A model or processor could not be loaded; the message says what was tried and what to do."""


@dataclass
class LoraSection:
    """LoRA through PEFT; TRL's GRPOTrainer wraps the model itself."""

    r: int = option(16, "LoRA rank.", ge=1)
    alpha: int = option(32, "LoRA scaling numerator (peft's lora_alpha).", gt=0)
    dropout: float = option(0.05, "Dropout on the LoRA branch.", ge=0, lt=1)
    target_modules: Union[list[str], str, None] = option(
        None,
        "Modules to adapt: names, a regex PEFT full-matches, or 'all-linear' (unset: the language model's linear "
        "layers).",
    )
    merge_for_generation: bool = option(
        True,
        "Generate through adapters merged into a copy of the base weights, as fast as the base model "
        "(docs/benchmarks.md, LoRA).",
    )


@dataclass
class ModelSection:
    """The policy model (``model:`` in a run config)."""

    name_or_path: str = option("", "HF folder, hub id (local cache only offline), or folder holding a GGUF file.")
    gguf_file: Union[str, None] = option(None, "GGUF file name inside name_or_path (dequantised on load).")
    dtype: Literal["float32", "bfloat16", "float16", "auto"] = option("float32", "Weights dtype.")
    attn_implementation: Union[str, None] = option(None, "Attention kernel, e.g. sdpa, eager or flash_attention_2.")
    trust_remote_code: bool = option(False, "Run the model's own code from its folder (InternVL3.5 needs it).")
    revision: Union[str, None] = option(None, "Hub revision (branch, tag or commit) of a hub id.")
    init_kwargs: dict[str, Any] = option(
        default_factory=dict,
        help="More keyword arguments of every from_pretrained of the model (training.model_init_kwargs, TRL's "
        "name, lands here).",
    )
    gradient_checkpointing: bool = option(False, "Also sets TRL's flag of the same name.")
    lora: Union[LoraSection, None] = option(None, "Set to train a LoRA adapter instead of all weights.")
    vision: VisionSection = option(
        default_factory=VisionSection, help="Image resolution and frozen parts of a vision-language model."
    )


# --------------------------------------------------------------------------- helpers
def _offline() -> bool:
    return any(
        os.environ.get(k, "").strip().lower() in {"1", "true", "yes", "on"}
        for k in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")
    )


def torch_dtype(name: str):
    import torch

    if name not in _DTYPES:
        raise ValueError(f"model.dtype: {name!r} is not one of {', '.join(_DTYPES)}")
    return "auto" if name == "auto" else getattr(torch, name)


def model_source(cfg: ModelSection) -> tuple[str, bool]:
    """(what to pass to from_pretrained, is it a local folder)."""
    raw = str(cfg.name_or_path or "").strip()
    if not raw:
        raise ModelLoadError(
            "model.name_or_path is empty: set it to a local model folder "
            "(e.g. .cache/models/SmolLM2-135M-Instruct) or a cached hub id"
        )
    p = Path(os.path.expanduser(raw))
    if p.exists():
        return str(p), True
    looks_local = raw.startswith((".", "/", "~")) or raw.count("/") > 1 or "\\" in raw or raw.endswith(".gguf")
    if looks_local:
        raise ModelLoadError(
            f"model.name_or_path: no such folder {str(p.resolve())!r}. Point it at a local folder with "
            f"config.json and weights (scripts/prepare_smollm2.py writes .cache/models/SmolLM2-135M-Instruct; "
            f"scripts/make_tiny_models.py writes tiny test models), or at a folder holding a GGUF file "
            f"together with model.gguf_file."
        )
    return raw, False


def model_file(cfg: ModelSection, name: str) -> Path | None:
    """The file ``name`` of the model's folder (a local folder, or a hub id in the local Hugging
    Face cache), or None; nothing is loaded or downloaded."""
    raw = str(cfg.name_or_path or "").strip()
    if not raw:
        return None
    if Path(raw).exists():
        return Path(raw, name) if Path(raw, name).is_file() else None
    from huggingface_hub import try_to_load_from_cache

    try:
        found = try_to_load_from_cache(raw, name, revision=cfg.revision)
    except ValueError:  # not a hub id
        return None
    return Path(found) if isinstance(found, str) else None


#: The named special tokens a tokenizer_config.json may give (a string, or an AddedToken's dict).
_NAMED_TOKENS = ("bos_token", "eos_token", "pad_token", "unk_token", "sep_token", "cls_token", "mask_token")


def special_tokens(cfg: ModelSection) -> tuple[str, ...]:
    """The special tokens of the model's tokenizer (its chat template's control tokens among them,
    e.g. ``<|im_end|>``), longest first, read from its files without loading it: a question holding
    one would end its turn in the rendered prompt and write the next (a prompt injection). Empty
    when the files are not found (a GGUF file's tokenizer lives inside it)."""
    read = lambda name: (read_json(path) if (path := model_file(cfg, name)) else None) or {}
    found: set[str] = set()
    config = read("tokenizer_config.json")
    for key in _NAMED_TOKENS:
        token = config.get(key)
        found.add(token.get("content") if isinstance(token, dict) else token)
    for key in ("extra_special_tokens", "additional_special_tokens"):
        extra = config.get(key)
        found.update(extra if isinstance(extra, list) else extra.values() if isinstance(extra, dict) else ())
    added = [*(config.get("added_tokens_decoder") or {}).values()]
    added += read("tokenizer.json").get("added_tokens") or []
    found.update(t.get("content") for t in added if isinstance(t, dict) and t.get("special"))
    return tuple(sorted((t for t in found if isinstance(t, str) and t.strip()), key=lambda t: (-len(t), t)))


def _load_kwargs(cfg: ModelSection, local: bool) -> dict:
    """Keyword arguments of every file's ``from_pretrained`` (config, tokenizer, processor, weights)."""
    kw: dict[str, Any] = {"trust_remote_code": bool(cfg.trust_remote_code)}
    if cfg.revision:
        kw["revision"] = cfg.revision
    if not local and _offline():
        kw["local_files_only"] = True
    return kw


def from_pretrained_kwargs(cfg: ModelSection) -> dict[str, Any]:
    """The weights' ``from_pretrained`` settings beyond the path, dtype and remote code, in the
    form TRL's ``model_init_kwargs`` takes them (TRL's reference model, evaluation, export)."""
    out = dict(cfg.init_kwargs)
    if cfg.revision:
        out["revision"] = cfg.revision
    if cfg.attn_implementation:
        out["attn_implementation"] = cfg.attn_implementation
    return out


def recorded_model(model: dict) -> ModelSection:
    """The model section a run folder records (its config.json) as far as loading the run's
    checkpoints again needs it: remote code, revision, attention, ``from_pretrained`` extras and
    the image resolution (evaluation and export use what training used)."""
    return ModelSection(
        name_or_path=str(model.get("name_or_path") or ""),
        trust_remote_code=bool(model.get("trust_remote_code", False)),
        revision=model.get("revision"),
        attn_implementation=model.get("attn_implementation"),
        init_kwargs=dict(model.get("init_kwargs") or {}),
        vision=from_dict(VisionSection, model.get("vision") or {}, "model.vision"),
    )


def _fail(what: str, src: str, local: bool, err: BaseException) -> ModelLoadError:
    if local:
        tried = f"local folder {str(Path(src).resolve())!r}"
        hint = (
            "Check that it holds config.json and the weights (*.safetensors), or the GGUF file named by "
            "model.gguf_file."
        )
    else:
        mode = "the local Hugging Face cache only (HF_HUB_OFFLINE=1)" if _offline() else "the Hugging Face hub"
        tried = f"hub id {src!r} from {mode}; no local folder of that name exists"
        hint = (
            "Download or convert the model into a folder and set model.name_or_path to that folder "
            "(e.g. .cache/models/SmolLM2-135M-Instruct from scripts/prepare_smollm2.py)."
        )
    return ModelLoadError(
        f"could not load the {what}: tried {tried}. {hint} "
        f"({type(err).__name__}: {str(err).strip().splitlines()[0] if str(err).strip() else ''})"
    )


def _raw_config(src: str, local: bool, kw: dict, gguf_file: str | None) -> dict | None:
    """config.json as a dict without running any remote code (None when unavailable)."""
    if gguf_file:
        return None
    try:
        if local:
            path = Path(src) / "config.json"
        else:
            from transformers.utils import cached_file

            path = cached_file(
                src,
                "config.json",
                local_files_only=kw.get("local_files_only", False),
                _raise_exceptions_for_missing_entries=False,
            )
        if path and Path(path).is_file():
            return json.loads(Path(path).read_text(encoding="utf-8"))
    except Exception:  # noqa: BLE001 - only a pre-check; AutoConfig reports real problems
        return None
    return None


def check_remote_code(raw: dict | None, trust: bool, src: str) -> None:
    if not raw:
        return
    mt = raw.get("model_type", "")
    family = REMOTE_CODE_MODEL_TYPES.get(mt)
    needs = family is not None or (bool(raw.get("auto_map")) and not _known_model_type(mt))
    if needs and not trust:
        name = family or f"model_type {mt!r}"
        raise ModelLoadError(
            f"{src!r} is a {name} checkpoint whose modeling code ships with the checkpoint "
            f"(model_type {mt!r}, auto_map in config.json). Loading it runs that code: set "
            f"model.trust_remote_code: true in the config (only for checkpoints you trust)."
        )


def _known_model_type(mt: str) -> bool:
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    return mt in CONFIG_MAPPING_NAMES


# --------------------------------------------------------------------------- image-only processors
def image_only_processor_class(base: type) -> type:
    """Subclass of a processor class whose ``__init__`` takes a ``video_processor``, without it.

    In transformers 5, Qwen2-VL / Qwen2.5-VL / InternVL processors insist on a video
    processor, and building one needs torchvision. The subclass drops ``video_processor``
    from the processor's attributes: the base ``__init__`` still runs (with
    ``video_processor=None``; ``ProcessorMixin`` zips its positional arguments with the
    attributes, so the ``None`` is ignored), ``from_pretrained`` loads only the image
    processor and tokenizer, and ``save_pretrained`` writes no video config."""

    def get_attributes(cls):
        return [a for a in super(sub, cls).get_attributes() if a != "video_processor"]

    def __call__(self, images=None, text=None, videos=None, **kwargs):
        if videos is not None:
            raise ValueError(f"{type(self).__name__} handles images only (a video processor needs torchvision)")
        return base.__call__(self, images=images, text=text, **kwargs)

    sub = type(
        f"ImageOnly{base.__name__}",
        (base,),
        {
            "get_attributes": classmethod(get_attributes),
            "__call__": __call__,
            "__module__": __name__,
            "__doc__": (
                f"{base.__name__} without the video processor (image processor + tokenizer + chat "
                "template): transformers 5 insists on a video processor, which needs torchvision."
            ),
        },
    )
    return sub


#: model_type -> its image-only processor class, made on first use (building one imports transformers).
IMAGE_ONLY_PROCESSORS: dict[str, type] = {}


def image_only_processor(model_type: str) -> type | None:
    """The image-only processor class for a model type (None if its processor needs no video part)."""
    if model_type in IMAGE_ONLY_PROCESSORS:
        return IMAGE_ONLY_PROCESSORS[model_type]
    try:
        import transformers
        from transformers.models.auto.processing_auto import PROCESSOR_MAPPING_NAMES

        base = getattr(transformers, PROCESSOR_MAPPING_NAMES.get(model_type) or "", None)
    except Exception:  # noqa: BLE001
        return None
    if base is None or "video_processor" not in base.get_attributes():
        return None
    IMAGE_ONLY_PROCESSORS[model_type] = image_only_processor_class(base)
    return IMAGE_ONLY_PROCESSORS[model_type]


def _read_chat_template(src: str, local: bool, kw: dict) -> str | None:
    names = ("chat_template.jinja", "chat_template.json")
    for name in names:
        try:
            if local:
                path = Path(src) / name
            else:
                from transformers.utils import cached_file

                path = cached_file(
                    src,
                    name,
                    local_files_only=kw.get("local_files_only", False),
                    _raise_exceptions_for_missing_entries=False,
                )
            if path and Path(path).is_file():
                text = Path(path).read_text(encoding="utf-8")
                return json.loads(text)["chat_template"] if name.endswith(".json") else text
        except Exception:  # noqa: BLE001 - optional file
            continue
    return None


def _is_processor(obj: Any) -> bool:
    from transformers.processing_utils import ProcessorMixin

    return isinstance(obj, ProcessorMixin) and getattr(obj, "image_processor", None) is not None


def load_processor(src: str, local: bool, config: Any, kw: dict):
    """A real multimodal processor for a VLM (never a bare tokenizer)."""
    from transformers import AutoImageProcessor, AutoProcessor, AutoTokenizer

    mt = getattr(config, "model_type", "")
    err: BaseException | None = None
    try:
        proc = AutoProcessor.from_pretrained(src, **kw)
        if _is_processor(proc):
            return proc
        logger.info("AutoProcessor gave %s for %s; building the processor explicitly", type(proc).__name__, src)
    except Exception as e:  # noqa: BLE001 - torchvision missing, unknown processor class, ...
        err = e
        logger.info(
            "AutoProcessor failed for %s (%s: %s); building the processor explicitly", src, type(e).__name__, e
        )
    cls = image_only_processor(mt)
    if cls is None:
        if err is not None:
            raise _fail(f"processor of {mt!r}", src, local, err) from err
        raise ModelLoadError(
            f"{src!r}: AutoProcessor returned a bare tokenizer for the vision-language model "
            f"type {mt!r}, and TRL needs a processor to feed it images. Add the processor "
            f"files (preprocessor_config.json / processor_config.json) to the folder"
            + (
                "; for InternVL use the transformers-native '-HF' checkpoint (model_type internvl)."
                if mt == "internvl_chat"
                else "."
            )
        )
    try:
        image_processor = AutoImageProcessor.from_pretrained(src, **kw)
        tokenizer = AutoTokenizer.from_pretrained(src, **kw)
    except Exception as e:
        raise _fail("image processor / tokenizer", src, local, e) from e
    template = _read_chat_template(src, local, kw) or getattr(tokenizer, "chat_template", None)
    _prepare_tokenizer(tokenizer)
    return cls(image_processor=image_processor, tokenizer=tokenizer, chat_template=template)


def _prepare_tokenizer(tok) -> None:
    if tok.pad_token is None and tok.eos_token is not None:
        tok.pad_token = tok.eos_token
    tok.padding_side = "left"


# --------------------------------------------------------------------------- GGUF
def load_gguf_plain(folder: str, gguf_file: str, dtype="float32", **kw):
    """Dequantise a GGUF checkpoint and copy it into a plain model (no ``quantization_config``).

    transformers keeps ``hf_quantizer``/``quantization_config`` on a GGUF-loaded model, which
    makes ``save_pretrained`` refuse it and TRL treat it as "purely quantized"; a fresh model
    built from the config without that key holds the same (dequantised) weights."""
    from transformers import AutoModelForCausalLM

    wanted = torch_dtype(dtype) if isinstance(dtype, str) else dtype
    extra = {}
    try:  # force dequantisation even where GGUF matmul kernels would keep the blocks packed
        from transformers import GgufConfig

        extra["quantization_config"] = GgufConfig(gguf_file=str(Path(folder) / gguf_file), dequantize=True)
    except ImportError:  # pragma: no cover - older transformers always dequantise
        pass
    attn = kw.pop("attn_implementation", None)
    loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=gguf_file, dtype=wanted, **extra, **kw)
    config = copy.deepcopy(loaded.config)  # re-reading it from the GGUF file costs seconds
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    if attn:
        config._attn_implementation = attn
    real_dtype = next(loaded.parameters()).dtype if wanted == "auto" else wanted
    model = AutoModelForCausalLM.from_config(config, dtype=real_dtype)
    state = loaded.state_dict()
    missing, unexpected = model.load_state_dict(state, strict=False)
    tied = bool(getattr(config, "tie_word_embeddings", False))
    missing = [k for k in missing if not (tied and k.endswith("lm_head.weight"))]
    if missing or unexpected:
        raise ModelLoadError(
            f"GGUF {gguf_file!r}: weights do not match the architecture "
            f"(missing {missing[:5]}, unexpected {unexpected[:5]})"
        )
    if tied:
        model.tie_weights()
    model.generation_config = loaded.generation_config
    del loaded, state
    return model.eval()


# --------------------------------------------------------------------------- one path for every load
@dataclass
class Source:
    """A model's files, resolved once; every load of it (weights, tokenizer or processor) reads these."""

    path: str  # what from_pretrained takes: a local folder or a hub id
    local: bool
    kwargs: dict[str, Any]  # every file's from_pretrained settings: remote code, revision, offline
    config: Any  # its AutoConfig


def open_source(model_cfg: ModelSection) -> Source:
    """The model's folder (or cached hub id) and config, remote code refused unless the config
    allows it; a failure is one :class:`ModelLoadError` naming what was tried."""
    from transformers import AutoConfig

    src, local = model_source(model_cfg)
    kw = _load_kwargs(model_cfg, local)
    trust = kw["trust_remote_code"]
    check_remote_code(_raw_config(src, local, kw, None), trust, src)
    try:
        config = AutoConfig.from_pretrained(src, **kw)
    except Exception as e:
        if "trust_remote_code" in str(e) and not trust:
            raise ModelLoadError(
                f"{src!r} needs custom code from the checkpoint: set model.trust_remote_code: "
                f"true in the config (only for checkpoints you trust). ({e})"
            ) from e
        raise _fail("model config", src, local, e) from e
    if getattr(config, "model_type", "") in REMOTE_CODE_MODEL_TYPES and not trust:
        raise ModelLoadError(f"{src!r} is an InternVL checkpoint with remote code: set model.trust_remote_code: true")
    return Source(src, local, kw, config)


def load_processing(source: Source, vision: VisionSection):
    """The tokenizer (pad token, left padding), or for a VLM a real processor (never a bare
    tokenizer) with the run's image resolution (``vision``: the one place it is applied)."""
    from transformers import AutoTokenizer

    if is_vision_language(source.config):
        processing = load_processor(source.path, source.local, source.config, source.kwargs)
        set_image_resolution(processing, vision)
        _prepare_tokenizer(processing.tokenizer)
        return processing
    try:
        processing = AutoTokenizer.from_pretrained(source.path, **source.kwargs)
    except Exception as e:
        raise _fail("tokenizer", source.path, source.local, e) from e
    _prepare_tokenizer(processing)
    return processing


def model_class(config: Any):
    """``AutoModelForCausalLM`` for a language model; for a VLM the class that wrote it (its
    ``architectures``), else the image-text-to-text auto class (``AutoModel`` for remote code)."""
    import transformers

    if not is_vision_language(config):
        return transformers.AutoModelForCausalLM
    if getattr(config, "model_type", "") in REMOTE_CODE_MODEL_TYPES:
        return transformers.AutoModel  # its auto_map registers AutoModel, not the image-text-to-text class
    arch = (getattr(config, "architectures", None) or [""])[0]
    return getattr(transformers, arch, None) or transformers.AutoModelForImageTextToText


def concrete_class(cls, config: Any, trust: bool):
    """The model class an auto class picks for ``config`` (an auto class needs a folder or
    hub id to load from, not a bare state dict)."""
    if getattr(cls, "_model_mapping", None) is None:
        return cls
    auto_map = getattr(config, "auto_map", None) or {}
    if trust and cls.__name__ in auto_map:  # the checkpoint's own modeling code, as the auto class would load it
        from transformers.dynamic_module_utils import get_class_from_dynamic_module

        return get_class_from_dynamic_module(auto_map[cls.__name__], config._name_or_path)
    from transformers.models.auto.auto_factory import _get_model_class

    return _get_model_class(config, cls._model_mapping)


def load_weights(source: Source, dtype: str, extra: dict[str, Any] | None = None, state_dict: dict | None = None):
    """The weights of ``source`` (or ``state_dict`` into its config's model) in ``dtype``, with
    :func:`model_class`: the one ``from_pretrained`` of the policy, checkpoints and export.
    ``extra``: :func:`from_pretrained_kwargs`. Weights missing from the checkpoint are an error,
    never filled with random values."""
    cls = model_class(source.config)
    kw = {**source.kwargs, **(extra or {}), "dtype": torch_dtype(dtype), "output_loading_info": True}
    if state_dict is None:
        model, info = cls.from_pretrained(source.path, **kw)
    else:
        cls = concrete_class(cls, source.config, bool(source.kwargs.get("trust_remote_code")))
        model, info = cls.from_pretrained(None, config=source.config, state_dict=state_dict, **kw)
    missing = sorted(info.get("missing_keys") or [])
    if missing:
        raise ModelLoadError(
            f"{source.path}: weights missing from the checkpoint: {missing[:5]}{' ...' if len(missing) > 5 else ''}"
        )
    return model


# --------------------------------------------------------------------------- public API
def load_policy(model_cfg: ModelSection) -> tuple[Any, Any]:
    """Load ``(model, processing_class)`` as described in the module docstring."""
    from transformers import AutoTokenizer

    if model_cfg.gguf_file:
        src, local = model_source(model_cfg)
        kw, gguf_file = _load_kwargs(model_cfg, local), model_cfg.gguf_file
        if local and not (Path(src) / gguf_file).is_file():
            found = sorted(p.name for p in Path(src).glob("*.gguf"))
            raise ModelLoadError(
                f"model.gguf_file: {gguf_file!r} is not in {str(Path(src).resolve())!r} "
                f"(GGUF files there: {found or 'none'})"
            )
        try:
            model = load_gguf_plain(
                src,
                gguf_file,
                torch_dtype(model_cfg.dtype or "float32"),
                **{**kw, **from_pretrained_kwargs(model_cfg)},
            )
            tok = AutoTokenizer.from_pretrained(src, gguf_file=gguf_file, **kw)
        except ModelLoadError:
            raise
        except Exception as e:
            raise _fail(f"GGUF model {gguf_file!r}", src, local, e) from e
        _prepare_tokenizer(tok)
        _finish(model, tok, model_cfg)
        return model, tok

    torch_dtype(model_cfg.dtype or "float32")  # a bad dtype before anything loads
    source = open_source(model_cfg)
    # The processing class first: it is cheap, and a missing processor should not wait for the weights.
    processing = load_processing(source, model_cfg.vision)
    try:
        model = load_weights(source, model_cfg.dtype or "float32", from_pretrained_kwargs(model_cfg))
    except ModelLoadError:
        raise
    except Exception as e:
        raise _fail("model weights", source.path, source.local, e) from e
    # A config-level quantization_config (e.g. a saved GGUF conversion) would block fine-tuning.
    if getattr(model, "hf_quantizer", None) is None and hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    _finish(model, processing, model_cfg)
    return model, processing


def _finish(model, processing, model_cfg: ModelSection) -> None:
    tok = getattr(processing, "tokenizer", processing)
    gen = getattr(model, "generation_config", None)
    if gen is not None and gen.pad_token_id is None and tok.pad_token_id is not None:
        gen.pad_token_id = tok.pad_token_id
    text_cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    if getattr(text_cfg, "pad_token_id", None) is None and tok.pad_token_id is not None:
        text_cfg.pad_token_id = tok.pad_token_id
    freeze_parts(model, model_cfg.vision)
    if model_cfg.gradient_checkpointing:
        # transformers 5 renamed it (activation_checkpointing_enable); the old name still works, with a warning.
        enable = getattr(model, "activation_checkpointing_enable", None)
        if enable is not None:
            enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.config.use_cache = False


def peft_config(model_cfg: ModelSection, model: Any = None):
    """``peft.LoraConfig`` from ``model_cfg.lora`` (None when LoRA is off); for TRL's ``peft_config=``.
    The targets follow :func:`~crystal_grpo.train.models.vision.lora_targets` (the capacity plan's rule
    too): unset, every linear layer of the language model (``model``, when given and a VLM: its
    language model's only, named by :func:`~crystal_grpo.train.models.vision.language_lora_target`)."""
    lora = model_cfg.lora
    if lora is None:
        return None
    from peft import LoraConfig

    vlm = model is not None and is_vision_language(getattr(model, "config", None))
    target, language_only = lora_targets(lora.target_modules, vlm)
    if language_only:
        target = language_lora_target(model)
    return LoraConfig(
        r=int(lora.r),
        lora_alpha=int(lora.alpha),
        lora_dropout=float(lora.dropout),
        target_modules=target,
        bias="none",
        task_type="CAUSAL_LM",
    )


def adapter_base(folder: str | Path, override: str | None = None) -> str:
    """The base model of a LoRA adapter folder: ``override`` or its adapter config's
    ``base_model_name_or_path`` (a path relative to where training ran, or a hub id)."""
    config = Path(folder) / "adapter_config.json"
    try:
        name = override or json.loads(config.read_text(encoding="utf-8")).get("base_model_name_or_path")
    except (OSError, ValueError) as err:
        raise ModelLoadError(f"{config}: unreadable ({err})") from err
    if not name:
        raise ModelLoadError(f"{config}: no base_model_name_or_path; pass the base model folder")
    path = Path(os.path.expanduser(name))
    if path.is_dir():
        return str(path.resolve())
    if override or name.startswith((".", "/", "~")) or name.count("/") > 1:
        raise ModelLoadError(
            f"LoRA base model {name!r} ({'given' if override else str(config)}) is not a folder seen "
            f"from {os.getcwd()}: run from the folder training ran in, or pass the base model folder"
        )
    return name  # a hub id; offline, from the local cache


def load_checkpoint(
    path: str | Path,
    dtype: str | None = None,
    trust_remote_code: bool = False,
    device: Any = None,
    base_model: str | None = None,
    model_kwargs: dict[str, Any] | None = None,
    vision: VisionSection | None = None,
) -> tuple[Any, Any]:
    """A checkpoint the trainer wrote ready to generate: ``(model in eval mode, processing
    class)``. A LoRA adapter is loaded onto its base and merged (PEFT ``merge_and_unload``),
    so generation runs at full-model speed. ``model_kwargs``: the run's
    :func:`from_pretrained_kwargs`; ``vision``: its image resolution (default: ``model.vision``'s
    defaults). A folder without a model is a one-line :class:`ModelLoadError`."""
    folder = Path(path)
    adapter = (folder / "adapter_config.json").is_file()
    if not folder.is_dir() or not (adapter or (folder / "config.json").is_file()):
        raise ModelLoadError(
            f"{str(path)!r} is not a model folder (expected config.json with weights, or a LoRA "
            "adapter_config.json, as in a run's checkpoint-N/ or final/)"
        )
    source = adapter_base(folder, base_model) if adapter else str(folder)
    kwargs = dict(model_kwargs or {})
    model, processing = load_policy(
        ModelSection(
            name_or_path=source,
            dtype=dtype or "float32",
            trust_remote_code=trust_remote_code,
            attn_implementation=kwargs.pop("attn_implementation", None),
            revision=kwargs.pop("revision", None) if adapter else None,  # a revision of the base, not of the folder
            init_kwargs=kwargs,
            vision=vision or VisionSection(),
        )
    )
    if adapter:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, str(folder)).merge_and_unload()
        if any((folder / f).is_file() for f in ("tokenizer_config.json", "tokenizer.json")) and not _is_processor(
            processing
        ):
            from transformers import AutoTokenizer

            processing = AutoTokenizer.from_pretrained(str(folder), trust_remote_code=trust_remote_code)
            _prepare_tokenizer(processing)
    if device is not None:
        model.to(device)
    return model.eval(), processing

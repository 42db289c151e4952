"""The vision side of a vision-language model: its image resolution, its parts, which of them train.

- Image resolution (``model.vision.max_pixels`` / ``min_pixels``): :func:`set_image_resolution`
  is the one place the bounds are put on a processor (every processor ``load_processing``
  loads); :func:`resized_image_tokens` counts a picture's tokens without transformers, for the
  capacity plan.
- Parts: the vision tower, the projector and the language model, found by each family's module
  paths in transformers 5 (:data:`VLM_PARTS`); an unknown model type trains as one piece.
- What trains: ``freeze_vision_tower`` / ``freeze_projector``; LoRA's default targets, the
  language model's linear layers (:func:`lora_targets`); :func:`parameter_line` reports it.

Why these defaults: docs/training.md, "Vision-language models".
"""

from __future__ import annotations

import logging
import math
import re
from dataclasses import dataclass
from typing import Any, Union

from crystal_grpo.errors import CrystalError
from crystal_grpo.typed import option

logger = logging.getLogger(__name__)

#: Known vision-language model types (others are found through the auto mapping or vision_config).
VLM_MODEL_TYPES = {
    "qwen2_vl",
    "qwen2_5_vl",
    "qwen3_vl",
    "qwen3_vl_moe",
    "internvl",
    "internvl_chat",
    "llava",
    "llava_next",
    "idefics3",
    "smolvlm",
    "gemma3",
    "paligemma",
    "mllama",
}

_QWEN = ("model.visual", ("model.visual.merger",), "model.language_model")
_LLAVA = ("model.vision_tower", ("model.multi_modal_projector",), "model.language_model")
_IDEFICS = ("model.vision_model", ("model.connector",), "model.text_model")
#: model_type -> (vision tower, projector(s), language model): module paths in the
#: ``...ForConditionalGeneration`` model of transformers 5, read from its modeling code. A
#: projector inside the vision tower (Qwen's merger) counts as the projector, not the tower.
VLM_PARTS: dict[str, tuple[str, tuple[str, ...], str]] = {
    "qwen2_vl": _QWEN,
    "qwen2_5_vl": _QWEN,
    "glm4v": _QWEN,
    "qwen3_vl": (_QWEN[0], ("model.visual.merger", "model.visual.deepstack_merger_list"), _QWEN[2]),
    "qwen3_vl_moe": (_QWEN[0], ("model.visual.merger", "model.visual.deepstack_merger_list"), _QWEN[2]),
    "llava": _LLAVA,
    "llava_next": _LLAVA,
    "llava_onevision": _LLAVA,
    "internvl": _LLAVA,
    "gemma3": _LLAVA,
    "paligemma": _LLAVA,
    "mllama": ("model.vision_model", ("model.multi_modal_projector",), "model.language_model"),
    "idefics3": _IDEFICS,
    "smolvlm": _IDEFICS,
}
PART_NAMES = ("vision tower", "projector", "language model")
#: (min_pixels, max_pixels) of Qwen2.5-VL's published processor (its preprocessor_config.json):
#: what a run gets with ``model.vision.min_pixels`` / ``max_pixels`` null.
PUBLISHED_QWEN_PIXELS = (3_136, 12_845_056)


class VisionError(CrystalError, ValueError):
    """A vision setting the model cannot honour (e.g. freezing the vision tower of an unknown family)."""


@dataclass
class VisionSection:
    """Vision-language models (``model.vision:``; a text model ignores it): the image resolution
    every processor of the run uses (training, validation, the SFT phase, evaluation, export)
    and which parts of the model train."""

    max_pixels: Union[int, None] = option(
        602112,
        "Largest image area in pixels, larger images resized down to it (null: the processor's own; "
        "docs/training.md, vision).",
        ge=1,
    )
    min_pixels: Union[int, None] = option(
        3136,
        "Smallest image area in pixels, smaller images resized up to it (null: the processor's own).",
        ge=1,
    )
    freeze_vision_tower: bool = option(
        False,
        "Keep the vision encoder's weights fixed in full fine-tuning (LoRA leaves it alone by default).",
    )
    freeze_projector: bool = option(False, "Keep the projector (vision encoder -> language model) fixed too.")


def is_vision_language(config: Any) -> bool:
    """Whether an ``AutoConfig`` describes a vision-language (image-text-to-text) model."""
    mt = getattr(config, "model_type", "")
    if mt in VLM_MODEL_TYPES:
        return True
    try:
        from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES

        if mt in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES:
            return True
    except ImportError:  # pragma: no cover
        pass
    return getattr(config, "vision_config", None) is not None


# --------------------------------------------------------------------------- image resolution
def _pixel_bounded(image_processor: Any) -> bool:
    """A Qwen2-VL-family image processor: ``size`` holds area bounds in pixels (other families'
    ``shortest_edge``/``longest_edge`` are edge lengths) and images become patch grids."""
    try:
        keys = {k for k, v in dict(getattr(image_processor, "size", None)).items() if v is not None}
    except (TypeError, ValueError):  # no size, or a single number
        keys = set()
    return {"shortest_edge", "longest_edge"} <= keys and all(
        hasattr(image_processor, a) for a in ("patch_size", "merge_size", "temporal_patch_size")
    )


def set_image_resolution(processing: Any, vision: VisionSection) -> None:
    """Put ``vision.min_pixels`` / ``max_pixels`` on a processor's image processor (the unset one
    keeps the processor's own). Other families keep their own resizing, with one warning."""
    image_processor = getattr(processing, "image_processor", None)
    bounds = {"shortest_edge": vision.min_pixels, "longest_edge": vision.max_pixels}
    bounds = {k: v for k, v in bounds.items() if v is not None}
    if image_processor is None or not bounds:
        return
    if not _pixel_bounded(image_processor):
        logger.warning(
            "model.vision.min_pixels / max_pixels apply to Qwen2-VL-family image processors (area bounds "
            "in pixels); %s keeps its own resizing",
            type(image_processor).__name__,
        )
        return
    size = image_processor.size
    image_processor.size = type(size)(**{**dict(size), **bounds})
    for key, value in (("min_pixels", vision.min_pixels), ("max_pixels", vision.max_pixels)):
        if value is not None and getattr(image_processor, key, None) is not None:
            setattr(image_processor, key, value)  # older processors read these instead of size


def image_tokens(processing: Any, height: int, width: int) -> int | None:
    """How many tokens an image of ``height`` x ``width`` pixels becomes (None: not a Qwen2-VL-family processor)."""
    image_processor = getattr(processing, "image_processor", None)
    if image_processor is None or not _pixel_bounded(image_processor):
        return None
    return image_processor.get_number_of_image_patches(height, width) // image_processor.merge_size**2


def resized_image_tokens(height: int, width: int, min_pixels: int, max_pixels: int, factor: int = 28) -> int:
    """The tokens a ``height`` x ``width`` image becomes under a Qwen2-VL-family processor with
    these bounds, without transformers (``--check`` imports none): its ``smart_resize`` (sides
    rounded to multiples of ``factor`` = patch x merge, the area brought within the bounds, the
    aspect ratio kept), one token per ``factor`` x ``factor`` pixels. tests/test_capacity.py
    checks it against the processor (:func:`image_tokens`)."""
    h, w = round(height / factor) * factor, round(width / factor) * factor
    if h * w > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h, w = (max(factor, math.floor(x / beta / factor) * factor) for x in (height, width))
    elif h * w < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h, w = (math.ceil(x * beta / factor) * factor for x in (height, width))
    return (h // factor) * (w // factor)


def resolution_line(processing: Any) -> str | None:
    """The image resolution a processor applies, in pixels and tokens (None for a text model)."""
    image_processor = getattr(processing, "image_processor", None)
    if image_processor is None:
        return None
    if not _pixel_bounded(image_processor):
        return f"images: {type(image_processor).__name__}'s own resizing (model.vision's bounds are Qwen2-VL-family's)"
    size = dict(image_processor.size)
    low, high = size["shortest_edge"], size["longest_edge"]
    side = image_processor.patch_size * image_processor.merge_size
    return (
        f"images: {low:,}-{high:,} pixels, {max(1, low // side**2):,}-{high // side**2:,} tokens an image "
        f"(one per {side} x {side} pixels; model.vision.min_pixels / max_pixels)"
    )


# --------------------------------------------------------------------------- parts
@dataclass
class Parts:
    """A vision-language model's parts, as modules of the model."""

    family: str
    vision: Any
    projectors: list
    language: Any
    language_path: str


def _unwrapped(model: Any) -> Any:
    """The transformers model inside a PEFT wrapper (the same modules: LoRA layers sit inside them)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def vlm_parts(model: Any) -> Parts | None:
    """The model's parts, or None (a text model, or a family :data:`VLM_PARTS` does not know)."""
    model = _unwrapped(model)
    config = getattr(model, "config", None)
    layout = VLM_PARTS.get(getattr(config, "model_type", ""))
    if layout is None:
        return None
    vision, projectors, language = layout
    try:
        found = [model.get_submodule(p) for p in (vision, language)]
    except AttributeError:
        return None
    present = []
    for path in projectors:
        try:
            present.append(model.get_submodule(path))
        except AttributeError:
            continue
    return Parts(config.model_type, found[0], present, found[1], language)


def _unknown(model: Any) -> str:
    mt = getattr(getattr(_unwrapped(model), "config", None), "model_type", "?")
    return f"model_type {mt!r} (vision tower / projector / language model known for: {', '.join(sorted(VLM_PARTS))})"


def part_parameters(model: Any) -> dict[str, list] | None:
    """Each part's parameters (a projector inside the vision tower belongs to the projector; the
    rest of the model, its output layer included, to the language model); None when unknown."""
    parts = vlm_parts(model)
    if parts is None:
        return None
    projector = {id(p): p for m in parts.projectors for p in m.parameters()}
    vision = [p for p in parts.vision.parameters() if id(p) not in projector]
    taken = set(projector) | {id(p) for p in vision}
    return {
        "vision tower": vision,
        "projector": list(projector.values()),
        "language model": [p for p in model.parameters() if id(p) not in taken],
    }


def freeze_parts(model: Any, vision: VisionSection) -> None:
    """``requires_grad = False`` on the parts ``vision`` freezes (the optimizer then skips them)."""
    frozen = [
        name
        for name, on in (("vision tower", vision.freeze_vision_tower), ("projector", vision.freeze_projector))
        if on
    ]
    if not frozen:
        return
    if not is_vision_language(getattr(model, "config", None)):
        logger.warning("model.vision.freeze_*: %s is a text model; nothing to freeze", type(model).__name__)
        return
    params = part_parameters(model)
    if params is None:
        raise VisionError(
            f"model.vision.freeze_*: cannot tell the {' and '.join(frozen)} apart in "
            f"{_unknown(model)}; unset the freeze or use a known family"
        )
    for name in frozen:
        for p in params[name]:
            p.requires_grad_(False)


def _numel(p: Any) -> int:
    return int(getattr(p, "ds_numel", 0) or p.numel())  # ZeRO-3 leaves each rank a slice: ds_numel is the whole


def parameter_counts(model: Any) -> dict[str, tuple[int, int]]:
    """(trainable, total) per part; one entry, ``model``, for a text model or an unknown family."""
    params = part_parameters(model) or {"model": list(model.parameters())}
    return {
        name: (sum(_numel(p) for p in ps if p.requires_grad), sum(_numel(p) for p in ps))
        for name, ps in params.items()
    }


def parameter_line(model: Any) -> str:
    """What trains, said when a run starts: ``trainable parameters: T of N (x%)``, per part for a VLM."""
    counts = parameter_counts(model)
    trainable, total = (sum(c[i] for c in counts.values()) for i in (0, 1))
    line = f"trainable parameters: {trainable:,} of {total:,} ({trainable / max(total, 1):.1%})"
    if "model" not in counts:
        return (
            line
            + ": "
            + ", ".join(
                f"{name} {t:,} of {n:,}" + (" (frozen)" if n and not t else "") for name, (t, n) in counts.items()
            )
        )
    if is_vision_language(getattr(_unwrapped(model), "config", None)):
        return line + f"; not split into parts: {_unknown(model)}"
    return line


def lora_targets(
    target_modules: Union[str, list[str], None], vision_language: bool
) -> tuple[Union[str, list[str]], bool]:
    """``(PEFT's target_modules, language model only)`` for a ``model.lora.target_modules`` setting:
    the one rule the trainer (``train.models.peft_config``) and the capacity plan
    (``train/capacity/estimate.py``, without a model) follow. An explicit setting is PEFT's, as given
    (names, a regex PEFT full-matches, or ``all-linear``). Unset: every linear layer
    ``all-linear`` takes (PEFT leaves the output layer out), and for a vision-language model only
    those of its language model (on a model, :func:`language_lora_target` names them): the
    vision tower and the projector keep their weights."""
    if target_modules is None:
        return "all-linear", vision_language
    return (list(target_modules) if isinstance(target_modules, (list, tuple)) else target_modules), False


def language_lora_target(model: Any) -> Union[str, list[str]]:
    """LoRA targets for a VLM: its language model's linear layers, as one regex PEFT full-matches
    (``model\\.language_model\\..*\\.(q_proj|...)``), or their names where a regex would catch
    another module too. ``all-linear`` (with a warning) for a family without known parts."""
    import torch

    parts = vlm_parts(model)
    if parts is None:
        logger.warning("LoRA adapts every linear layer, the vision tower's too: %s", _unknown(model))
        return "all-linear"
    prefix = parts.language_path + "."
    names = {name for name, m in model.named_modules() if name.startswith(prefix) and isinstance(m, torch.nn.Linear)}
    if not names:
        raise VisionError(
            f"no linear layer under {parts.language_path} for LoRA to adapt; set model.lora.target_modules"
        )
    leaves = sorted({n.rsplit(".", 1)[-1] for n in names})
    regex = re.escape(prefix) + r"(?:.*\.)?(?:" + "|".join(map(re.escape, leaves)) + ")"
    if {name for name, _ in model.named_modules() if re.fullmatch(regex, name)} == names:
        return regex
    return sorted(names)

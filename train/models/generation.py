"""Batched generation from the training prompt: the one home for validation and evaluation.

The prompt is exactly what GRPO generates from (the row's conversational ``prompt`` through
the chat template, images through TRL's multimodal message preparation), so a validation
or evaluation score measures the policy that was trained, not a different prompt. Whether TRL's vLLM
path can run with what is installed: :func:`vllm_problem`.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # torch loads with the first generation: a command's --help need not wait for it
    import torch

from crystal_grpo.typed import ConfigError

#: Where a user gets vLLM: the tested set (requirements-vllm.lock; docs/training.md, "Generation in vLLM").
VLLM_SETUP = "on a CUDA GPU machine, make setup-vllm installs the tested vLLM set into .venv-vllm (docs/training.md)"


def trl_vllm_range() -> str | None:
    """The vLLM releases the installed TRL supports: its ``vllm`` extra's specifier (None: it has none)."""
    import importlib.metadata

    from packaging.requirements import Requirement

    for line in importlib.metadata.requires("trl") or []:
        req = Requirement(line)
        if req.name == "vllm" and req.marker is not None and req.marker.evaluate({"extra": "vllm"}):
            return str(req.specifier)
    return None


def vllm_problem() -> str | None:
    """Why ``training.use_vllm: true`` cannot run with what is installed (metadata only, nothing
    imported): vLLM missing, or a release outside the installed TRL's supported range."""
    import importlib.metadata
    import importlib.util

    from packaging.specifiers import SpecifierSet

    if importlib.util.find_spec("vllm") is None:
        return f"vLLM is not installed; {VLLM_SETUP}, or set it false to generate with transformers"
    try:
        version = importlib.metadata.version("vllm")
    except importlib.metadata.PackageNotFoundError:  # a source checkout on the path: nothing to compare
        return None
    supported = trl_vllm_range()
    if supported and not SpecifierSet(supported).contains(version, prereleases=True):
        return (
            f"vLLM {version} is installed and TRL {importlib.metadata.version('trl')} supports vllm{supported}; "
            f"{VLLM_SETUP}"
        )
    return None


@dataclass
class Sampling:
    """How completions are drawn: greedy (temperature 0, the paper's evaluation) or sampled."""

    max_new_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    num_samples: int = 1

    def __post_init__(self) -> None:
        """A negative temperature ran greedy while the report said it was sampled at that temperature."""
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise ConfigError(f"--temperature {self.temperature}: expected a number >= 0 (0: greedy decoding)")
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"--top_p {self.top_p}: expected a number in (0, 1]")

    def generate_kwargs(self) -> dict[str, Any]:
        if self.temperature <= 0:
            return {"do_sample": False, "num_return_sequences": self.num_samples}
        return {
            "do_sample": True,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "num_return_sequences": self.num_samples,
        }


@dataclass(frozen=True)
class Engine:
    """How the prompt is rendered and transformers runs generation: the choices TRL's
    GRPOConfig offers for training (``chat_template_kwargs``, ``cache_implementation``,
    ``use_transformers_continuous_batching``), so validation takes the path training takes
    (:meth:`from_trainer`).

    ``generate`` with the default dynamic KV cache, with a preallocated one
    (``cache_implementation: static``), or continuous batching (``generate_batch``: paged KV
    cache, finished sequences replaced by waiting ones; text-only models). Greedy output is
    the same token for token on the tests' model in fp32 (tests/test_generation.py); in bf16
    kernels differ, so ties may break differently.
    """

    cache_implementation: str | None = None
    continuous_batching: bool = False
    continuous_batching_config: Any = None  # transformers' ContinuousBatchingConfig; None: its defaults
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_trainer(cls, trainer) -> Engine:
        args = trainer.args
        return cls(
            getattr(args, "cache_implementation", None),
            bool(getattr(args, "use_transformers_continuous_batching", False)),
            getattr(trainer, "continuous_batching_config", None),
            dict(getattr(trainer, "chat_template_kwargs", None) or {}),
        )


def _encode(
    processing_class, prompts: Sequence, images: Sequence | None, chat_template_kwargs: dict[str, Any]
) -> dict[str, torch.Tensor]:
    from trl.data_utils import prepare_multimodal_messages

    from crystal_grpo.train.data.splits import prompt_text

    tok = getattr(processing_class, "tokenizer", processing_class)
    if images is not None:
        msgs = [prepare_multimodal_messages(p, images=im) for p, im in zip(prompts, images)]
        texts = [prompt_text(processing_class, m, chat_template_kwargs) for m in msgs]
        return processing_class(
            text=texts, images=[x for im in images for x in im] or None, padding=True, return_tensors="pt"
        )
    texts = [
        p if isinstance(p, str) else prompt_text(tok, p, chat_template_kwargs) for p in prompts
    ]  # a plain-text prompt goes in as it is, as TRL does with one
    return tok(texts, padding=True, return_tensors="pt", add_special_tokens=False)


def generate_batches(
    model,
    processing_class,
    prompts: Sequence,
    images: Sequence | None,
    sampling: Sampling,
    batch_size: int,
    engine: Engine = Engine(),
) -> Iterator[list[list[str]]]:
    """For each chunk of ``batch_size`` prompts, ``num_samples`` completions per prompt (left
    padding, special tokens dropped); yields chunk by chunk so callers can save as they go."""
    import torch

    tok = getattr(processing_class, "tokenizer", processing_class)
    if engine.continuous_batching and images is not None:
        raise ValueError("continuous batching generates text-only prompts; this model takes images")
    side, tok.padding_side = tok.padding_side, "left"
    device = next(model.parameters()).device
    k = sampling.num_samples
    try:
        for i in range(0, len(prompts), batch_size):
            enc = _encode(
                processing_class,
                prompts[i : i + batch_size],
                None if images is None else images[i : i + batch_size],
                engine.chat_template_kwargs,
            )
            with torch.no_grad():  # (not around the yield: the caller's grad mode stays its own)
                if engine.continuous_batching:
                    ids = _generate_continuous(model, tok, enc, sampling, engine)
                else:
                    enc = {key: v.to(device) for key, v in enc.items()}
                    ids = model.generate(
                        **enc,
                        max_new_tokens=sampling.max_new_tokens,
                        pad_token_id=tok.pad_token_id,
                        cache_implementation=engine.cache_implementation,
                        **sampling.generate_kwargs(),
                    )
                    ids = ids[:, enc["input_ids"].shape[1] :]
            texts = tok.batch_decode(ids, skip_special_tokens=True)
            yield [texts[j : j + k] for j in range(0, len(texts), k)]
    finally:
        tok.padding_side = side


def _generate_continuous(
    model, tok, enc: dict[str, torch.Tensor], sampling: Sampling, engine: Engine
) -> list[list[int]]:
    """``generate_batch`` on the unpadded prompts; its results come back in request order
    (samples of one prompt together), and a request that failed fails the call."""
    from transformers import GenerationConfig

    prompts = [ids[mask.bool()].tolist() for ids, mask in zip(enc["input_ids"], enc["attention_mask"])]
    config = GenerationConfig(
        max_new_tokens=sampling.max_new_tokens,
        pad_token_id=tok.pad_token_id,
        eos_token_id=model.generation_config.eos_token_id,
        **sampling.generate_kwargs(),
    )
    out = model.generate_batch(
        prompts,
        generation_config=config,
        continuous_batching_config=engine.continuous_batching_config,
        progress_bar=False,
    )
    expected = len(prompts) * sampling.num_samples
    failed = [r.request_id for r in out.values() if r.error is not None]
    if len(out) != expected or failed:
        raise RuntimeError(
            f"continuous batching returned {len(out) - len(failed)} of {expected} completions (failed: {failed[:3]})"
        )
    return [list(r.generated_tokens) for r in out.values()]


def generate(
    model,
    processing_class,
    prompts: Sequence,
    images: Sequence | None,
    sampling: Sampling,
    batch_size: int,
    engine: Engine = Engine(),
) -> list[list[str]]:
    """All completions at once: ``num_samples`` per prompt, in prompt order."""
    return [
        c
        for chunk in generate_batches(model, processing_class, prompts, images, sampling, batch_size, engine)
        for c in chunk
    ]

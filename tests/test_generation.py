"""Generation paths (train/models/generation.py): a static KV cache and continuous batching give
greedy completions token for token equal to plain ``generate`` (tiny model, fp32), keep each
prompt's samples together, and validation takes the path the training config names."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, ContinuousBatchingConfig, GenerationMixin
from trl import GRPOConfig

from crystal_grpo.jsonl import read_jsonl
from crystal_grpo.train import grpo
from crystal_grpo.train.config.run_config import load_config
from crystal_grpo.train.models.generation import Engine, Sampling, generate

#: Candidate prompts: the test takes the first three whose greedy completions differ, so that
#: "every prompt got its own completion back" can fail, whatever model this machine built.
POOL = [[{"role": "user", "content": r["question"]}] for r in read_jsonl("data/wordproblems/train.jsonl")[:24]]
#: Completion length: enough for the random tiny model's completions to differ (continuous
#: batching costs about a second a token here, so not more).
TOKENS = 12


@pytest.fixture(scope="module")
def lm(tiny_lm_path):
    return AutoModelForCausalLM.from_pretrained(tiny_lm_path).eval(), AutoTokenizer.from_pretrained(tiny_lm_path)


@pytest.fixture(scope="module")
def prompts(lm) -> list:
    completions = generate(*lm, POOL, None, Sampling(max_new_tokens=TOKENS), batch_size=8)
    first: dict[str, list] = {}
    for prompt, (text,) in zip(POOL, completions):
        first.setdefault(text, prompt)
    assert len(first) >= 3, "the tiny model gives the same greedy completion to almost every prompt"
    return list(first.values())[:3]


#: A paged cache sized for the test: left to its defaults, transformers sizes it from free memory
#: (on CPU: most of the machine's RAM, 40 s of filling it with zeros at each call).
SMALL_PAGED_CACHE = ContinuousBatchingConfig(num_blocks=16, max_batch_tokens=256)


@pytest.mark.parametrize(
    "engine",
    [
        Engine(cache_implementation="static"),
        Engine(continuous_batching=True, continuous_batching_config=SMALL_PAGED_CACHE),
    ],
    ids=["static-cache", "continuous-batching"],
)
def test_greedy_completions_equal_plain_generate(lm, prompts, engine):
    model, tok = lm
    greedy = Sampling(max_new_tokens=TOKENS)
    plain = generate(model, tok, prompts, None, greedy, batch_size=3)
    assert generate(model, tok, prompts, None, greedy, batch_size=3, engine=engine) == plain
    assert len({c[0] for c in plain}) == len(prompts), "prompts must give different completions"
    # Two samples per prompt at a temperature so low that both are the greedy completion: they
    # come back in prompt order, each prompt's samples together.
    near_greedy = Sampling(max_new_tokens=TOKENS, temperature=1e-4, num_samples=2)
    assert generate(model, tok, prompts, None, near_greedy, batch_size=3, engine=engine) == [c * 2 for c in plain]


def test_continuous_batching_refuses_images(lm):
    model, tok = lm
    with pytest.raises(ValueError, match="text-only"):
        generate(model, tok, POOL[:1], [[object()]], Sampling(8), 1, Engine(continuous_batching=True))


def test_engine_follows_the_grpo_config():
    args = GRPOConfig(
        output_dir="unused",
        cache_implementation="static",
        use_transformers_continuous_batching=True,
        use_cpu=True,
        report_to=[],
    )
    engine = Engine.from_trainer(SimpleNamespace(args=args, continuous_batching_config="cfg"))
    assert engine == Engine("static", True, "cfg")
    assert (
        Engine.from_trainer(SimpleNamespace(args=GRPOConfig(output_dir="unused", use_cpu=True, report_to=[])))
        == Engine()
    )


def test_validation_generates_with_the_training_cache(tmp_path, tiny_lm_path, monkeypatch):
    seen = []
    original = GenerationMixin.generate

    def recording(self, *args, **kwargs):
        if not torch.is_grad_enabled() and "cache_implementation" in kwargs:  # validation passes it by name
            seen.append(kwargs["cache_implementation"])
        return original(self, *args, **kwargs)

    monkeypatch.setattr(GenerationMixin, "generate", recording)
    cfg, _ = load_config(
        "tiny.yaml",
        [
            "--model.name_or_path",
            str(tiny_lm_path),
            "--training.max_steps",
            "1",
            "--training.cache_implementation",
            "static",
            "--validation.eval_steps",
            "1",
        ],
    )
    grpo.run(cfg, tmp_path / "run")
    assert seen and set(seen) == {"static"}
    assert (tmp_path / "run" / "validation.jsonl").read_text().count("\n") >= 2  # start and step 1

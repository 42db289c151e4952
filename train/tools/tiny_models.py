"""Tiny random-weight models for tests, built from configs in a few seconds (no hub access).

    python scripts/make_tiny_models.py [OUT_DIR]      # default .cache/models/

Builds (skipping any that already exist):
- ``OUT_DIR/tiny-qwen2``: ``Qwen2ForCausalLM`` (hidden 64, 2 layers, 4 heads, 2 KV heads)
  with a byte-level BPE tokenizer (vocab ~1000) trained on text from the word-problem
  templates, the system prompt and the JSON output format; Qwen chat template; then a
  few seconds of supervised warm-up on short JSON answers (``warm_up_format``) so its
  sampled completions earn varied rewards.
- ``OUT_DIR/tiny-qwen2.5-vl``: ``Qwen2_5_VLForConditionalGeneration`` (text hidden 64,
  2 layers; vision depth 1, hidden 32) with the same tokenizer plus the vision special
  tokens, the PIL image processor (56*56 .. 112*112 pixels) and a chat template that
  takes list content (text and image parts).

``build_mid_lm(path)`` (not built by default) makes a Qwen2.5-0.5B-shaped model with the
same tokenizer for GPU benchmarks (``scripts/bench_train.py --model mid``).

``build_tiny_lm(path)`` and ``build_tiny_vlm(path)`` are what the tests' session fixtures call
(``tests/conftest.py``); ``scripts/make_tiny_models.py`` is the command. The folders load with
``crystal_grpo.train.models.load_policy``. Both are deterministic (fixed seed), so two
builds give the same token ids and weights.
"""

from __future__ import annotations

import functools
import json
import math
import os
from pathlib import Path

from crystal_grpo.train.tools import wordproblems

#: Relative to the folder the command runs in (configs/tiny.yaml names .cache/models/tiny-qwen2).
DEFAULT_OUT = Path(".cache") / "models"
LM_NAME = "tiny-qwen2"
VLM_NAME = "tiny-qwen2.5-vl"
VOCAB_SIZE = 1000
#: The weights' seed. ``CRYSTAL_TINY_SEED`` changes it, to flush out tests that pass only
#: because of what one model happens to sample (another CPU's float rounding gives another model).
SEED = int(os.environ.get("CRYSTAL_TINY_SEED", "0"))

# Qwen2's pre-tokenizer split (transformers' tokenization_qwen2.PRETOKENIZE_REGEX). In
# transformers 5 the Qwen2 tokenizer class re-imposes this normaliser and pre-tokenizer
# on reload (model_type qwen2), so the BPE is trained with exactly these settings or ids
# change after save/reload.
PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"""
    r"""\s*[\r\n]+|\s+(?!\S)|\s+"""
)

TEXT_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
VISION_SPECIALS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]

# Qwen style; string content or a list of {"type": "text"|"image", ...} parts.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' or 'image' in part %}{{ '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{{ '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def corpus() -> list[str]:
    """Text the tokenizer is trained on: word problems, steps, JSON answers, prompts."""
    rows = wordproblems.generate(1500, seed=99)
    lines = [
        "Solve the problem step by step. Reply with exactly one JSON object and nothing else: "
        '{"reasoning_steps": ["<step 1>", "<step 2>", "..."], "answer": "<final answer>"}. '
        "Each step is one short sentence. For multiple choice, answer with the option letter.",
        "You are a helpful assistant.",
        "system user assistant Options: (A) (B) (C) (D) yes no true false",
        "How many red circles are there? Are there more squares than triangles? Which shape appears most often?",
        "I count the blue squares: there are 3. green yellow shapes picture total",
        "0 1 2 3 4 5 6 7 8 9 10 11 12 + - * / = $ % . , : ; ! ? ( ) [ ] { } \" ' ` \n ```json\n```",
    ]
    words = (
        "so the answer is first then next after that finally therefore because we have has had get gets "
        "left total each more less than times half twice sum difference product per hour hours minutes "
        "dollars cost costs price change pay pays buy buys sell sells share shares equal equally friends "
        "old older younger years ago will be was were are there how many much what which who when where "
        "count counts number numbers add subtract multiply divide plus minus option letter correct true "
        "false yes no image picture shape shapes circle square triangle red blue green yellow colour"
    )
    for _ in range(3):  # frequent enough (min_frequency 2) to become whole tokens
        lines.append(words)
        lines.extend(f"<|im_start|>{role}\n" for role in ("system", "user", "assistant"))
    for r in rows:
        steps = r["reference_steps"]
        lines.append(r["question"])
        lines.append(" ".join(steps))
        lines.append(json.dumps({"reasoning_steps": steps, "answer": r["answer"]}))
        if r.get("choices"):
            lines.append("Options: " + " ".join(f"({'ABCD'[i]}) {c}" for i, c in enumerate(r["choices"])))
    return lines


@functools.lru_cache(maxsize=2)
def train_tokenizer(vocab_size: int = VOCAB_SIZE):
    """A ``tokenizers.Tokenizer``: byte-level BPE with Qwen2's NFC normaliser and pre-tokenizer."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    tok = Tokenizer(
        models.BPE(
            unk_token=None, continuing_subword_prefix="", end_of_word_suffix="", fuse_unk=False, byte_fallback=False
        )
    )
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        show_progress=False,
        special_tokens=TEXT_SPECIALS + VISION_SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(corpus(), trainer=trainer)
    return tok


def _hf_tokenizer(tok, chat_template: str = CHAT_TEMPLATE, vision: bool = False):
    from transformers import Qwen2Tokenizer

    vocab = tok.get_vocab()
    merges = [
        tuple(m.split(" ", 1)) if isinstance(m, str) else tuple(m) for m in json.loads(tok.to_str())["model"]["merges"]
    ]
    # Special tokens are part of the trained vocab (ids 0..6), so adding them again reuses ids.
    extra = VISION_SPECIALS if vision else []
    hf = Qwen2Tokenizer(
        vocab=vocab,
        merges=merges,
        unk_token=None,
        bos_token=None,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>", "<|im_end|>"] + extra,
        padding_side="left",
    )
    hf.chat_template = chat_template
    hf.padding_side = "left"
    return hf


def _done(path: Path) -> bool:
    return (path / "config.json").exists() and any(path.glob("*.safetensors"))


def _new_qwen2(tok, hidden: int, intermediate: int, layers: int, heads: int, max_positions: int):
    """A seeded random ``Qwen2ForCausalLM`` sized for the project tokenizer (2 KV heads)."""
    import torch
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(SEED)
    config = Qwen2Config(
        vocab_size=len(tok),
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=2,
        max_position_embeddings=max_positions,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        dtype="float32",
    )
    model = Qwen2ForCausalLM(config)
    model.generation_config = GenerationConfig(
        eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, bos_token_id=None
    )
    return model


def _save(model, tok, path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    model.to("cpu").save_pretrained(path)
    tok.save_pretrained(path)
    return path


def build_tiny_lm(path: str | Path, overwrite: bool = False) -> Path:
    """Tiny ``Qwen2ForCausalLM`` + trained tokenizer in ``path`` (skipped when present)."""
    path = Path(path)
    if _done(path) and not overwrite:
        return path
    tok = _hf_tokenizer(train_tokenizer())
    model = _new_qwen2(tok, hidden=64, intermediate=128, layers=2, heads=4, max_positions=2048)
    warm_up_format(model, tok)
    return _save(model, tok, path)


def warm_up_format(
    model,
    tok,
    steps: int = 300,
    batch_size: int = 16,
    lr: float = 5e-3,
    target_steps: int | None = 1,
    warmup_steps: int = 0,
    padding_side: str = "left",
    max_grad_norm: float | None = None,
) -> float:
    """A few seconds of supervised training on JSON answers to the word problems.

    A random-weight model never writes the JSON output format, so every reward is 0,
    every GRPO advantage is 0 and nothing trains. After this warm-up the tiny model's
    sampled completions are JSON-like with varied steps and answers: some parse, some
    match a reference step, some are right, so GRPO tests see real reward variance.
    The defaults are sized so that this holds for any seed, not for one lucky model: 150
    steps at lr 1e-2 left 8% of sampled completions (temperature 0.9) parseable with one
    seed and 53% with another; 300 steps at 5e-3 give 66-92% over seeds 0-4 (one CPU thread).
    ``target_steps`` reference steps go into each target (None: all of them). Runs on the
    model's device (bf16 autocast on CUDA); returns the last loss. On CUDA pad on the
    right: a left-padded row's first queries see no key at all, and CUDA's attention
    kernels turn such rows into NaN gradients.
    """
    import random

    import torch

    from crystal_grpo.train.data import build_prompt

    rows = wordproblems.generate(wordproblems.N_TRAIN, seed=wordproblems.SEED)  # data/wordproblems/train.jsonl
    texts = []
    for r in rows:
        target = json.dumps({"reasoning_steps": r["reference_steps"][:target_steps], "answer": r["answer"]})
        prompt = tok.apply_chat_template(build_prompt(r), add_generation_prompt=True, tokenize=False)
        texts.append(prompt + target + tok.eos_token)
    device = next(model.parameters()).device
    rng = random.Random(SEED)
    torch.manual_seed(SEED)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # bit-identical builds on any machine (CPU)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: min(1.0, (i + 1) / (warmup_steps + 1)))
    model.train()
    side, tok.padding_side = tok.padding_side, padding_side
    try:
        for _ in range(steps):
            enc = tok(rng.sample(texts, batch_size), return_tensors="pt", padding=True, add_special_tokens=False).to(
                device
            )
            labels = enc["input_ids"].masked_fill(enc["attention_mask"] == 0, -100)
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
                loss = model(**enc, labels=labels).loss
            loss.backward()
            if max_grad_norm is not None:
                torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
            opt.step()
            sched.step()
            opt.zero_grad()
    finally:
        torch.set_num_threads(threads)
        tok.padding_side = side
    model.eval()
    return loss.item()


def build_tiny_gguf(lm_path: str | Path, path: str | Path, name: str = "tiny.gguf") -> Path:
    """The tiny LM (:func:`build_tiny_lm`) as an unquantised GGUF file in ``path``, the format
    the demo's SmolLM2 ships in, so the GGUF loading path is tested without a download."""
    import gguf
    import numpy as np
    from safetensors.numpy import load_file

    lm_path, path = Path(lm_path), Path(path)
    path.mkdir(parents=True, exist_ok=True)
    cfg = json.loads((lm_path / "config.json").read_text())
    tok = json.loads((lm_path / "tokenizer.json").read_text())
    layers = cfg["num_hidden_layers"]
    w = gguf.GGUFWriter(str(path / name), "qwen2")
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_block_count(layers)
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_rope_freq_base(cfg["rope_parameters"]["rope_theta"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    special = {t["id"]: t["content"] for t in tok.get("added_tokens", [])}
    by_id = {i: t for t, i in tok["model"]["vocab"].items()} | special
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list([by_id.get(i, "") for i in range(max(by_id) + 1)])
    w.add_token_types([3 if i in special else 1 for i in range(max(by_id) + 1)])  # 3: control
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]])
    w.add_eos_token_id(cfg["eos_token_id"])
    w.add_pad_token_id(cfg["pad_token_id"])
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.QWEN2, layers)
    for key, tensor in load_file(str(lm_path / "model.safetensors")).items():
        w.add_tensor(names.get_name(key, try_suffixes=(".weight", ".bias")), tensor.astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path / name


def build_mid_lm(
    path: str | Path, overwrite: bool = False, layers: int = 24, hidden: int = 896, steps: int = 400
) -> Path:
    """A Qwen2.5-0.5B-shaped ``Qwen2ForCausalLM`` (24 layers, hidden 896, 14 heads, 2 KV
    heads; about 360M parameters with the project tokenizer) for GPU benchmarks.

    Random weights, then a format warm-up on full JSON answers (every reference step) on
    the GPU when there is one, so GRPO completions hold several steps and the benchmark
    pays the scorer's real cost. Not a model that reasons: for timing and memory only.
    """
    path = Path(path)
    if _done(path) and not overwrite:
        return path
    import torch

    tok = _hf_tokenizer(train_tokenizer())
    model = _new_qwen2(
        tok, hidden=hidden, intermediate=hidden * 38 // 7, layers=layers, heads=hidden // 64, max_positions=4096
    ).to("cuda" if torch.cuda.is_available() else "cpu")
    loss = warm_up_format(
        model,
        tok,
        steps=steps,
        batch_size=16,
        lr=3e-4,
        target_steps=None,
        warmup_steps=steps // 10,
        padding_side="right",
        max_grad_norm=1.0,
    )
    print(f"{path.name}: {sum(p.numel() for p in model.parameters()) / 1e6:.0f}M parameters, warm-up loss {loss:.3f}")
    if not math.isfinite(loss):
        raise RuntimeError(f"{path.name}: the format warm-up diverged (loss {loss})")
    return _save(model, tok, path)


def _image_processor():
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    return Qwen2VLImageProcessorPil(
        min_pixels=56 * 56, max_pixels=112 * 112, patch_size=14, temporal_patch_size=2, merge_size=2
    )


def build_tiny_vlm(path: str | Path, overwrite: bool = False) -> Path:
    """Tiny ``Qwen2_5_VLForConditionalGeneration`` + image-only processor in ``path``."""
    path = Path(path)
    if _done(path) and not overwrite:
        return path
    import torch
    from transformers import GenerationConfig, Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    from crystal_grpo.train.models import image_only_processor

    tok = _hf_tokenizer(train_tokenizer(), vision=True)
    ids = {t: tok.convert_tokens_to_ids(t) for t in VISION_SPECIALS}
    heads, hidden = 4, 64
    # head_dim = hidden // heads = 16: mrope_section must sum to head_dim / 2 = 8
    config = Qwen2_5_VLConfig(
        text_config=dict(
            vocab_size=len(tok),
            hidden_size=hidden,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=heads,
            num_key_value_heads=2,
            max_position_embeddings=4096,
            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [2, 3, 3]},
            bos_token_id=None,
            eos_token_id=tok.eos_token_id,
            pad_token_id=tok.pad_token_id,
        ),
        vision_config=dict(
            depth=1,
            hidden_size=32,
            intermediate_size=64,
            num_heads=2,
            out_hidden_size=hidden,
            patch_size=14,
            spatial_merge_size=2,
            temporal_patch_size=2,
            window_size=112,
            fullatt_block_indexes=[0],
        ),
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=True,
    )
    torch.manual_seed(SEED)
    model = Qwen2_5_VLForConditionalGeneration(config)
    model.generation_config = GenerationConfig(
        eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, bos_token_id=None
    )
    processor = image_only_processor("qwen2_5_vl")(
        image_processor=_image_processor(), tokenizer=tok, chat_template=CHAT_TEMPLATE
    )
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    processor.save_pretrained(path)
    return path


def main(argv: list[str] | None = None) -> None:
    import argparse
    import time

    ap = argparse.ArgumentParser(
        description="Build the tests' tiny random-weight models from configs (no hub "
        f"access): {LM_NAME} and {VLM_NAME}, skipping any that already exist."
    )
    ap.add_argument("out_dir", nargs="?", type=Path, default=DEFAULT_OUT, help="(default: %(default)s)")
    out = ap.parse_args(argv).out_dir
    for name, fn in ((LM_NAME, build_tiny_lm), (VLM_NAME, build_tiny_vlm)):
        t0 = time.time()
        p = out / name
        existed = _done(p)
        fn(p)
        print(f"{p}: {'already there' if existed else f'built in {time.time() - t0:.1f} s'}")

"""The model organism's policy: a task-made tokenizer and a tiny Llama, from scratch (docs/organism.md).

Built offline in seconds and saved as an ordinary HF folder, so the organism exercises the real
trainer, rewards, checkpoints, export and evaluation with no code path of its own. The
tokenizer is a byte-level BPE trained on the task's own text, one token a digit; it is a
``PreTrainedTokenizerFast`` on a Llama config because, unlike a ``Qwen2Tokenizer``, transformers
re-imposes no normaliser on reload, so the ids after a save and load are the ids that were
trained. The model is a ``LlamaForCausalLM`` with random weights, deterministic from the seed.
The warm start (``--warm_start``) is the SFT phase of configs/organism_warm_start.yaml, its
weights committed in data/organism/warm_start.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from crystal_grpo.train.data.splits import SYSTEM_PROMPT, build_prompt, render_target
from crystal_grpo.train.models.tokenizer import train_byte_level_bpe
from crystal_grpo.train.organism.task import Layout, SplitSizes, TaskSpec, make_split, write_splits, wrong_share

PAD, BOS_TURN, EOS = "<|pad|>", "<|im_start|>", "<|im_end|>"
#: The organism's instruction (``data.system_prompt`` in configs/organism*.yaml): a policy trained from
#: scratch needs no explanation of the format, and the project's default (about 60 tokens) would be
#: half of every prompt, so of every forward and backward pass.
SYSTEM_PROMPT_SHORT = "Reply in JSON."
#: The Qwen/ChatML layout, text content only: what ``train.data.build_prompt`` renders through.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
# Qwen2's split (words, single digits, punctuation runs, spaces) with a digit keeping the space before it
# (" 7" is one token), without Qwen2's case folding.
PRETOKENIZE_REGEX = (
    r"""'s|'t|'re|'ve|'m|'ll|'d|[^\r\n\p{L}\p{N}]?\p{L}+| ?\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)


@dataclass(frozen=True)
class PolicySpec:
    """The policy's size (default 0.65 M parameters)."""

    hidden: int = 128
    layers: int = 3  # 2 and 4 learn too; 3 for the step time (docs/organism.md, "The policy")
    heads: int = 4
    kv_heads: int = 2
    intermediate: int = 384
    max_positions: int = 512
    vocab_size: int = 512  # the BPE's target; the trained vocabulary may come out smaller
    seed: int = 0


def corpus(spec: TaskSpec) -> Iterable[str]:
    """Text the tokenizer learns from: prompts as the chat template renders them, targets in
    both step wordings, option lines, and the long-chain variable names."""
    # the chat template's role lines and the system prompt, often enough (min_frequency 2) for whole words
    lines = [SYSTEM_PROMPT, SYSTEM_PROMPT_SHORT, "system\nuser\nassistant\n"] * 3
    for wording in ("sentence", "equation"):
        s = replace(
            spec,
            wording=wording,
            shortcut_rate=0.3,
            hint_reliability=1.0,
            choice_rate=0.3,
            min_steps=1,
            max_steps=min(spec.max_steps + spec.long_extra, 20),
            long_extra=0,
        )
        for row in make_split(s, 600, seed=12345, partition="train", prefix="corpus"):
            lines.append(build_prompt(row)[1]["content"])
            lines.append(render_target(row))
    return lines


def train_tokenizer(spec: TaskSpec, vocab_size: int):
    """A ``tokenizers.Tokenizer``: byte-level BPE (every string encodes), single-digit tokens."""
    return train_byte_level_bpe(corpus(spec), PRETOKENIZE_REGEX, [PAD, BOS_TURN, EOS], vocab_size)


def hf_tokenizer(tok):
    """The trained tokenizer as transformers uses it: eos ends the assistant turn, left padding."""
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=EOS,
        pad_token=PAD,
        bos_token=None,
        unk_token=None,
        additional_special_tokens=[BOS_TURN],
        padding_side="left",
    )
    hf.chat_template = CHAT_TEMPLATE
    return hf


def new_policy(tok, spec: PolicySpec):
    """A seeded random ``LlamaForCausalLM`` sized for ``tok``."""
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(spec.seed)
    config = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=spec.hidden,
        intermediate_size=spec.intermediate,
        num_hidden_layers=spec.layers,
        num_attention_heads=spec.heads,
        num_key_value_heads=spec.kv_heads,
        max_position_embeddings=spec.max_positions,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        dtype="float32",
    )
    model = LlamaForCausalLM(config)
    model.generation_config = GenerationConfig(
        eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, bos_token_id=None
    )
    return model


def build_policy(
    path: str | Path, task: Layout | TaskSpec | None = None, spec: PolicySpec = PolicySpec(), overwrite: bool = False
) -> Path:
    """Tokenizer + random-weight policy in ``path``, left as it is when already built from the same
    knobs (``organism.json``): a folder built from other knobs is rebuilt, so a warm start never
    trains a tokenizer made for another task."""
    path = Path(path)
    task_spec = task.spec if isinstance(task, Layout) else (task or TaskSpec())
    record = json.dumps({"task": asdict(task_spec), "policy": asdict(spec)}, indent=2) + "\n"
    if not overwrite and built_from(path) == json.loads(record) and any(path.glob("*.safetensors")):
        return path
    tok = hf_tokenizer(train_tokenizer(task_spec, spec.vocab_size))
    model = new_policy(tok, spec)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    (path / "organism.json").write_text(record, encoding="utf-8")
    return path


def built_from(path: Path) -> dict | None:
    """The knobs a policy folder records (``organism.json``; None when absent or unreadable)."""
    try:
        return json.loads((path / "organism.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def parameter_count(path: str | Path) -> int:
    from transformers import AutoModelForCausalLM

    return sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(path).parameters())


DEFAULT_DIR = Path(".cache/organism")
#: The SFT phase that makes the committed warm start, and where its weights go (relative to the repo).
WARM_START_CONFIG = "organism_warm_start.yaml"
WARM_START_DIR = Path("data/organism/warm_start")
#: What a warm start folder holds: what ``AutoModelForCausalLM`` and ``AutoTokenizer`` load, and the
#: knobs it was built from (no optimizer state, no training arguments: a few MB to commit).
POLICY_FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
    "organism.json",
)


def train_warm_start(
    out: Path = DEFAULT_DIR,
    dest: Path = WARM_START_DIR,
    config: str = WARM_START_CONFIG,
    overrides: Sequence[str] = (),
) -> dict:
    """Run ``config``'s SFT phase on ``out``'s demonstrations from ``out/model`` through
    train/grpo.py's own machinery, then copy its final weights to ``dest``. Returns the phase's
    last validation. Why not a checkpoint: the committed folder must be reproducible by one command,
    and the CI learning check cannot afford the SFT phase itself."""
    import shutil

    from crystal_grpo.train.config.preflight import preflight
    from crystal_grpo.train.config.run_config import load_config
    from crystal_grpo.train.grpo import run

    paths = [
        "--model.name_or_path",
        str(out / "model"),
        "--data.train",
        str(out / "data" / "sft.jsonl"),
        "--data.validation",
        str(out / "data" / "val.jsonl"),
    ]
    cfg, _ = load_config(config, [*paths, *overrides])
    missing = preflight(cfg)
    if missing:
        raise SystemExit("cannot start the warm start: " + "; ".join(missing))
    run_dir = out / "runs" / "warm_start"
    summary = run(cfg, run_dir, overwrite=True)
    dest.mkdir(parents=True, exist_ok=True)
    for name in POLICY_FILES:
        shutil.copyfile((out / "model" if name == "organism.json" else run_dir / "final") / name, dest / name)
    return next(iter(summary.values()), {})


def main(argv: Sequence[str] | None = None) -> int:
    """``scripts/make_organism.py``: the task's splits and the random-weight policy, offline."""
    import argparse
    import time

    ap = argparse.ArgumentParser(description="Write the model organism: data splits and a from-scratch policy.")
    ap.add_argument("--out", default=str(DEFAULT_DIR), help="folder for data/ and model/ (default %(default)s)")
    ap.add_argument("--seed", type=int, default=0, help="data seed (held-out splits use seed+1..seed+3)")
    ap.add_argument("--model_seed", type=int, default=0, help="the policy's initial weights")
    ap.add_argument("--overwrite", action="store_true", help="rebuild the policy even if it exists")
    ap.add_argument(
        "--warm_start",
        action="store_true",
        help=f"then train the warm start (configs/{WARM_START_CONFIG}; docs/organism.md) into --warm_start_dir",
    )
    ap.add_argument("--warm_start_dir", default=str(WARM_START_DIR), help="(default %(default)s)")
    ap.add_argument("--warm_start_config", default=WARM_START_CONFIG, help="the SFT phase (default %(default)s)")
    for f in TaskSpec.__dataclass_fields__.values():
        if f.name in ("operands", "ops"):
            continue
        ap.add_argument(
            f"--{f.name}", type=type(f.default), default=f.default, help=f"task knob (default {f.default})"
        )
    ap.add_argument("--operands", default="1,3", help="inclusive operand range lo,hi (default %(default)s)")
    ap.add_argument("--ops", default="+,-", help="operations, from + - * (default %(default)s)")
    for f in SplitSizes.__dataclass_fields__.values():
        ap.add_argument(f"--n_{f.name}", type=int, default=f.default, help=f"rows (default {f.default})")
    for f in PolicySpec.__dataclass_fields__.values():
        if f.name != "seed":
            ap.add_argument(f"--{f.name}", type=int, default=f.default, help=f"policy size (default {f.default})")
    a = ap.parse_args(argv)
    knobs = {name: getattr(a, name) for name in TaskSpec.__dataclass_fields__ if name not in ("operands", "ops")}
    lo, hi = (int(x) for x in a.operands.split(","))
    spec = TaskSpec(operands=(lo, hi), ops=tuple(a.ops.split(",")), **knobs)
    sizes = SplitSizes(**{name: getattr(a, f"n_{name}") for name in SplitSizes.__dataclass_fields__})
    layout = Layout(spec, sizes, a.seed)
    out = Path(a.out)
    t0 = time.perf_counter()
    paths = write_splits(layout, out / "data")
    from crystal_grpo.jsonl import read_jsonl

    wrong = wrong_share(read_jsonl(paths["sft"]), read_jsonl(paths["train"]))
    print(
        f"{out / 'data'}: {', '.join(f'{k} {sizes_of(p)}' for k, p in paths.items())} rows; "
        f"demonstrations with a wrong answer: {wrong:.1%} ({time.perf_counter() - t0:.1f} s)"
    )
    t0 = time.perf_counter()
    policy = PolicySpec(
        seed=a.model_seed, **{name: getattr(a, name) for name in PolicySpec.__dataclass_fields__ if name != "seed"}
    )
    model = build_policy(out / "model", layout, policy, overwrite=a.overwrite)
    print(f"{model}: {parameter_count(model) / 1e6:.2f} M parameters ({time.perf_counter() - t0:.1f} s)")
    if a.warm_start:
        t0 = time.perf_counter()
        val = train_warm_start(out, Path(a.warm_start_dir), a.warm_start_config)
        print(
            f"{a.warm_start_dir}: warm start, held-out validation {json.dumps(val)} ({time.perf_counter() - t0:.0f} s)"
        )
    return 0


def sizes_of(path: Path) -> int:
    with open(path, "rb") as fh:
        return sum(1 for _ in fh)

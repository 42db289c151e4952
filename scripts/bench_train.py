#!/usr/bin/env python
"""Benchmark GRPO training through the real entry point: one process without DeepSpeed
(the baseline) against DeepSpeed ZeRO-3, full fine-tuning and LoRA (one table, one run).

    python scripts/bench_train.py [--model tiny|mid|PATH] [--settings plain-full,plain-lora,zero3-full,...]
        [--steps 5] [--warmup 2] [--batch 8] [--completion_length 128]
        [--encoder packaged:all-MiniLM-L6-v2] [--dtype bfloat16|float32]

Each setting is its own run of ``train/grpo.py --config tiny.yaml`` with overrides (CPR
reward with the sentence encoder on the training device, no validation, no checkpoints),
``--warmup + --steps`` optimizer steps of ``--batch`` completions (``--batch`` / 8 prompts
x 8 generations) of at most ``--completion_length`` tokens:
  plain    ``python train/grpo.py`` (one process, no DeepSpeed);
  zero3    CUDA: ``accelerate launch --config_file configs/accelerate/zero3_1x1.yaml``;
           CPU: ``torchrun --nproc_per_node 1 ... --cpu_backend gloo`` with zero3.json;
  -lora    adds ``model.lora`` (r 16, all linear layers); ``-pcgrad`` adds ``pcgrad: true``.
Models: ``tiny`` is the tests' tiny Qwen2 (built if missing); ``mid`` a Qwen2.5-0.5B-shaped
Qwen2 (about 360M parameters, random weights warmed up on the JSON format, built on the
first use: ``scripts/make_tiny_models.py build_mid_lm``); or any model folder.

Columns (medians over the measured steps, from the run's metrics.jsonl):
  step s     TRL's ``step_time``: generation + rewards + loss + backward + optimizer;
  ratio      step s / the same mode's ``plain`` step s measured in this run;
  peak GiB   CUDA max_memory_allocated over the run (not measured on CPU);
  score s    ``cpr/scoring_seconds``: parsing, answer checks, embedding and matching;
  share      score s / step s;
  format, steps   format rate and mean predicted steps of the completions (what the
             scorer had to embed).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

from crystal_grpo.jsonl import read_jsonl

REPO_ROOT = Path(__file__).resolve().parents[1]
MODELS = REPO_ROOT / ".cache" / "models"
GENERATIONS = 8


def build_model(name: str) -> str:
    """Path of ``tiny`` / ``mid`` (built on first use) or the folder given."""
    if name not in ("tiny", "mid"):
        return name
    import make_tiny_models as mk  # a sibling: scripts/ is sys.path[0] when this file runs

    build = mk.build_tiny_lm if name == "tiny" else mk.build_mid_lm
    return str(build(MODELS / ("tiny-qwen2" if name == "tiny" else "mid-qwen2")))


def command(setting: str, model: str, out: Path, a: argparse.Namespace, cuda: bool) -> list[str]:
    parts = setting.split("-")
    if parts[0] not in ("plain", "zero3") or parts[1] not in ("full", "lora") or not set(parts[2:]) <= {"pcgrad"}:
        raise SystemExit(f"setting {setting!r}: allowed are (plain|zero3)-(full|lora)[-pcgrad]")
    py = [sys.executable]
    if parts[0] == "plain":
        launch, extra = py, []
    elif cuda:
        launch = py + ["-m", "accelerate.commands.launch", "--config_file", "configs/accelerate/zero3_1x1.yaml"]
        extra = []
    else:
        launch = py + ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "1"]
        extra = ["--cpu_backend", "gloo", "--training.deepspeed", "configs/accelerate/zero3.json"]
    device = "cuda" if cuda else "cpu"
    args = [
        "train/grpo.py", "--config", "tiny.yaml", "--output_dir", str(out),
        "--model.name_or_path", model, "--model.dtype", a.dtype,
        "--data.validation", "null", "--data.validation_fraction", "0", "--data.max_train_samples", "null",
        "--reward.params", json.dumps({"encoder": a.encoder, "device": device}),
        "--training.max_steps", str(a.warmup + a.steps), "--training.save_strategy", "'no'",
        "--training.per_device_train_batch_size", str(a.batch), "--training.num_generations", str(GENERATIONS),
        "--training.max_completion_length", str(a.completion_length), "--training.logging_steps", "1",
        "--training.disable_tqdm", "true", "--training.use_cpu", str(not cuda).lower(),
    ]
    if parts[1] == "lora":
        args += ["--model.lora", "{r: 16, alpha: 32, dropout: 0.0, target_modules: all-linear}"]
    if "pcgrad" in parts:
        args += ["--pcgrad", "true"]
    return launch + args + extra


def summarise(out: Path, warmup: int) -> dict[str, float]:
    rows = read_jsonl(out / "metrics.jsonl")
    steps = [r for r in rows if "step_time" in r][warmup:]
    if not steps:
        raise SystemExit(f"{out}: no measured steps in metrics.jsonl")
    med = lambda key: statistics.median([r[key] for r in steps if key in r] or [math.nan])  # noqa: E731
    peak = [r["memory/max_allocated_gb"] for r in rows if "memory/max_allocated_gb" in r]
    return {"step": med("step_time"), "score": med("cpr/scoring_seconds"), "format": med("cpr/format_rate"),
            "steps": med("cpr/steps_mean"), "peak": max(peak, default=math.nan)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--settings", default="plain-full,plain-lora,zero3-full,zero3-lora")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--batch", type=int, default=8, help="completions per step (a multiple of 8)")
    ap.add_argument("--completion_length", type=int, default=128)
    ap.add_argument("--encoder", default="packaged:all-MiniLM-L6-v2")
    ap.add_argument("--dtype", default=None, help="default: bfloat16 on CUDA, float32 on CPU")
    ap.add_argument("--out", default=str(REPO_ROOT / "runs" / "bench_train"))
    a = ap.parse_args()
    import torch

    cuda = torch.cuda.is_available()
    a.dtype = a.dtype or ("bfloat16" if cuda else "float32")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))}
    model = build_model(a.model)
    device = torch.cuda.get_device_name() if cuda else f"CPU ({os.cpu_count()} cores)"
    print(f"GRPO steps on {device}: model {Path(model).name}, {a.dtype}, {a.batch} completions x "
          f"<= {a.completion_length} tokens, CPR reward ({a.encoder}), median of {a.steps} steps "
          f"after {a.warmup}")
    cols = ("setting", "step s", "ratio", "peak GiB", "score s", "share", "format", "steps")
    print(f"{cols[0]:<20}" + "".join(f"{c:>10}" for c in cols[1:]), flush=True)
    base: dict[str, float] = {}
    for setting in a.settings.split(","):  # a row as soon as its run ends (plain before zero3)
        out = Path(a.out) / f"{Path(model).name}-{setting}"
        shutil.rmtree(out, ignore_errors=True)
        proc = subprocess.run(command(setting, model, out, a, cuda), cwd=REPO_ROOT, env=env,
                              capture_output=True, text=True)
        if proc.returncode != 0:
            print(proc.stdout[-3000:] + proc.stderr[-6000:], file=sys.stderr)
            raise SystemExit(f"{setting}: exit {proc.returncode}")
        r = summarise(out, a.warmup)
        mode = setting.split("-")[1]
        if setting.startswith("plain-"):
            base.setdefault(mode, r["step"])
        print(f"{setting:<20}{r['step']:>10.3f}{r['step'] / base.get(mode, math.nan):>10.2f}{r['peak']:>10.2f}"
              f"{r['score']:>10.3f}{r['score'] / r['step']:>10.1%}{r['format']:>10.2f}{r['steps']:>10.1f}",
              flush=True)


if __name__ == "__main__":
    main()

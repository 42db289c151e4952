#!/usr/bin/env python
"""Benchmark GRPO training: this framework against plain TRL, LoRA against full fine-tuning,
DeepSpeed ZeRO-3 against one process (one table, every ratio measured in the same run).

    python scripts/bench_train.py [--model tiny|organism|mid|PATH] [--device cpu|cuda]
        [--settings trl-full,plain-full-answer,plain-full,plain-full-pcgrad,...] [--rounds 2]
        [--steps 5] [--warmup 2] [--batch 8] [--completion_length 128] [--threads N]

Settings are ``trl-(full|lora)`` (the baseline) or ``(plain|zero3)-(full|lora[-unmerged])
[-cpr|-answer][-pcgrad][-static|-cb]``; every setting runs the same model, data, batch, seed and
GRPOConfig. The settings, the models and the columns: docs/benchmarks.md, "What
bench_train.py runs and prints".
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
MODELS = REPO_ROOT / ".cache" / "models"
DEFAULT_SETTINGS = "trl-full,plain-full-answer,plain-full,plain-full-pcgrad,trl-lora,plain-lora"


def build_model(name: str) -> str:
    """Path of ``tiny`` / ``mid`` (built on first use), the organism's warm start (its data
    written on first use) or the folder given."""
    if name == "organism":
        from crystal_grpo.train.organism.policy import DEFAULT_DIR, WARM_START_DIR
        from crystal_grpo.train.organism.task import Layout, write_splits

        data = REPO_ROOT / DEFAULT_DIR / "data"
        if not (data / "train.jsonl").exists():
            write_splits(Layout(), data)
        return str(REPO_ROOT / WARM_START_DIR)
    if name not in ("tiny", "mid"):
        return name
    from crystal_grpo.train.fixtures import tiny_models as mk

    build = mk.build_tiny_lm if name == "tiny" else mk.build_mid_lm
    return str(build(MODELS / ("tiny-qwen2" if name == "tiny" else "mid-qwen2")))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--device", choices=("cpu", "cuda"), default=None, help="default: cuda when available")
    ap.add_argument("--settings", default=DEFAULT_SETTINGS)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--batch", type=int, default=8, help="completions per step (a multiple of 8)")
    ap.add_argument("--completion_length", type=int, default=128)
    ap.add_argument("--learning_rate", type=float, default=0.0)
    ap.add_argument("--seed", type=int, default=42)
    ap.add_argument("--encoder", default="packaged:all-MiniLM-L6-v2")
    ap.add_argument("--dtype", default=None, help="default: bfloat16 on CUDA, float32 on CPU")
    ap.add_argument("--threads", type=int, default=None, help="CPU threads per run (OMP_NUM_THREADS)")
    ap.add_argument("--out", default=str(REPO_ROOT / "runs" / "bench_train"))
    a = ap.parse_args()
    import torch  # after the arguments: --help answers at once

    from crystal_grpo.train.benchmarks.training import command, summarise, table

    cuda = (a.device or ("cuda" if torch.cuda.is_available() else "cpu")) == "cuda"
    a.dtype = a.dtype or ("bfloat16" if cuda else "float32")
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")])),
    }
    if a.threads:
        env["OMP_NUM_THREADS"] = env["MKL_NUM_THREADS"] = str(a.threads)
    model = build_model(a.model)
    # the organism runs its own config (data, prompt, validation off) and matches steps exactly
    a.config = "organism.yaml" if a.model == "organism" else "tiny.yaml"
    if a.model == "organism" and a.encoder == ap.get_default("encoder"):
        a.encoder = "exact"
    device = torch.cuda.get_device_name() if cuda else f"CPU ({os.cpu_count()} cores, {platform.machine()})"
    settings = a.settings.split(",")
    print(
        f"GRPO steps on {device}, {time.strftime('%Y-%m-%d')}: model {Path(model).name}, {a.dtype}, "
        f"{a.batch} completions x <= {a.completion_length} tokens, lr {a.learning_rate}, seed {a.seed}, "
        f"encoder {a.encoder}, threads {a.threads or 'default'}; median of {a.steps} steps after {a.warmup}, "
        f"{a.rounds} round(s) of "
        f"{len(settings)} settings",
        flush=True,
    )
    results: dict[str, list[dict]] = {s: [] for s in settings}
    for rnd in range(a.rounds):
        for setting in settings[rnd % len(settings) :] + settings[: rnd % len(settings)]:  # no setting always first
            out = Path(a.out) / f"{Path(model).name}-{setting}"
            shutil.rmtree(out, ignore_errors=True)
            proc = subprocess.run(
                command(setting, model, out, a, cuda), cwd=REPO_ROOT, env=env, capture_output=True, text=True
            )
            if proc.returncode != 0:
                print(proc.stdout[-3000:] + proc.stderr[-6000:], file=sys.stderr)
                raise SystemExit(f"{setting}: exit {proc.returncode}")
            r = summarise(out, a.warmup)
            results[setting].append(r)
            load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
            print(
                f"  round {rnd + 1} {setting:<22} step {r['step']:.3f} s  wall {r['wall']:.3f} s  "
                f"tokens {r['tokens']:.1f}  (load {load:.2f})",
                file=sys.stderr,
                flush=True,
            )
    print(table(results))


if __name__ == "__main__":
    main()

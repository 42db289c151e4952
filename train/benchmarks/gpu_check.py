"""The true-scale GPU check (``scripts/gpu_check.py``; docs/benchmarks.md, "The true-scale GPU check").

Qwen2.5-VL-3B built from its published configuration with random weights (no download), the
project tokenizer and an image-only processor, rows with real images at the run's default
resolution bounds, and a few GRPO steps per arm, each a separate process under DeepSpeed ZeRO-3
(one process): this framework with CPR + PCGrad, and plain ``trl.GRPOTrainer`` with the same
reward functions, for LoRA and for full fine-tuning. Every arm is a ``bench_train.py`` setting
(:mod:`crystal_grpo.train.benchmarks.training`), so both trainers get the same overrides. Per arm:
peak GPU memory against the capacity plan's prediction for one GPU, step time, its generation
share and completion tokens per second. ``--model tiny`` runs the same path on CPU with the tiny
VLM (peak memory is then not measured).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from crystal_grpo.train.config.run_config import CONFIG_DIR

REPO_ROOT = CONFIG_DIR.parent
#: This framework (CPR + PCGrad) and plain TRL with the same reward, each under ZeRO-3, per weights.
ARMS = ("zero3-lora-pcgrad", "trl-zero3-lora-cpr", "zero3-full-pcgrad", "trl-zero3-full-cpr")
#: The report's columns, in order (``None``: not measured, e.g. GPU memory on CPU).
COLUMNS = (
    "arm",
    "zero3",
    "peak_gib",
    "predicted_gib",
    "peak_over_predicted",
    "step_s",
    "generation_share",
    "completion_tokens",
    "tokens_per_s",
    "step_over_trl",
)
#: (height, width) of the rows' images for a model other than the 3B, which gets the capacity
#: plan's assumed picture (``ASSUMED_IMAGE``: 768 image tokens at the default bounds).
SMALL_IMAGE = (168, 224)
GIB = 2**30
ZERO3_JSON = "configs/accelerate/zero3.json"
REPORT = "gpu_check.json"


def qwen25_vl_3b_config(ids: dict[str, int], eos: int, pad: int) -> dict[str, Any]:
    """The published Qwen2.5-VL-3B config.json with the project tokenizer's special-token ids
    (the sizes, vocabulary included, stay the published ones)."""
    from crystal_grpo.train.capacity.estimate import QWEN25_VL_3B_CONFIG

    return {
        **QWEN25_VL_3B_CONFIG,
        "bos_token_id": None,
        "eos_token_id": eos,
        "pad_token_id": pad,
        "vision_start_token_id": ids["<|vision_start|>"],
        "vision_end_token_id": ids["<|vision_end|>"],
        "vision_token_id": ids["<|image_pad|>"],
        "image_token_id": ids["<|image_pad|>"],
        "video_token_id": ids["<|video_pad|>"],
    }


def predicted_gib(cmd: list[str]) -> float:
    """The capacity plan's peak for one GPU under ZeRO-3, for the run config ``cmd`` launches."""
    from crystal_grpo.train.benchmarks.training import config_and_folder
    from crystal_grpo.train.capacity.estimate import launch_from, model_sizes, plan, workload

    cfg, _ = config_and_folder(cmd[cmd.index("--config") :])
    sizes = model_sizes(cfg.model.name_or_path, None, cfg.model.dtype)
    launch = launch_from(deepspeed=str(REPO_ROOT / ZERO3_JSON), gpus=1)
    return plan(sizes, launch, workload(cfg, sizes, launch)).total / GIB


def arm_row(name: str, r: dict[str, float], predicted: float, batch: int) -> dict[str, Any]:
    """One arm's report row (without the ratio to plain TRL) from :func:`summarise`'s medians."""
    peak = None if math.isnan(r["peak"]) else r["peak"]
    return {
        "arm": name,
        "zero3": r["zero3"],
        "peak_gib": peak,
        "predicted_gib": predicted,
        "peak_over_predicted": None if peak is None else peak / predicted,
        "step_s": r["wall"],
        "generation_share": r["gen"] / r["wall"],
        "completion_tokens": r["tokens"],
        "tokens_per_s": r["tokens"] * batch / r["wall"],
    }


def with_trl_ratios(rows: dict[str, dict]) -> dict[str, dict]:
    """Each arm's step time over plain TRL's with the same weights, per completion token (None
    for TRL's own arms and where that arm did not run)."""
    from crystal_grpo.train.benchmarks.training import Setting

    for name, row in rows.items():
        s = Setting.parse(name)
        base = rows.get(f"trl-zero3-{s.weights}-cpr")
        per_token = lambda x: x["step_s"] / x["completion_tokens"]
        row["step_over_trl"] = None if s.trl or base is None else per_token(row) / per_token(base)
    return rows


def table(rows: dict[str, dict]) -> str:
    """The report as a fixed-width table; ``n/m``: not measured."""
    fmt = lambda v, spec: "n/m" if v is None else ("yes" if v else "no") if isinstance(v, bool) else format(v, spec)
    specs = ("", "", ".2f", ".2f", ".2f", ".2f", ".0%", ".0f", ".0f", ".2f")
    widths = [max(len(c), 20 if i == 0 else 8) for i, c in enumerate(COLUMNS)]
    lines = ["  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(COLUMNS, widths)))]
    for row in rows.values():
        cells = [fmt(row[c], spec) for c, spec in zip(COLUMNS, specs)]
        lines.append("  ".join(v.rjust(w) if i else v.ljust(w) for i, (v, w) in enumerate(zip(cells, widths))))
    return "\n".join(lines)


def main(
    build_model: Callable[[str, Path], Path],
    write_rows: Callable[[Path, tuple[int, int]], Path],
    argv: list[str] | None = None,
) -> int:
    """The check; ``build_model(name, models_dir)`` gives the model's folder (``3b`` built on the
    GPU, ``tiny``, or the folder named) and ``write_rows(folder, (height, width))`` the rows' file:
    the script passes the builders of ``train/fixtures``, which the library does not import."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="3b", help="3b, tiny (the tests' VLM) or the folder of a built VLM")
    ap.add_argument("--device", choices=("cpu", "cuda"), default=None, help="default: cuda when available")
    ap.add_argument("--arms", default=",".join(ARMS), help="comma-separated, from " + ", ".join(ARMS))
    ap.add_argument("--steps", type=int, default=3, help="measured steps per arm")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--batch", type=int, default=8, help="completions per step (a multiple of 8)")
    ap.add_argument("--completion_length", type=int, default=256)
    ap.add_argument("--learning_rate", type=float, default=1e-6)
    ap.add_argument("--seed", type=int, default=42)
    ap.add_argument("--encoder", default="packaged:all-MiniLM-L6-v2")
    ap.add_argument("--force", action="store_true", help="run arms the plan says do not fit the GPU")
    ap.add_argument("--out", type=Path, default=REPO_ROOT / "runs" / "gpu_check")
    a = ap.parse_args(argv)
    arms = a.arms.split(",")
    unknown = [x for x in arms if x not in ARMS]
    if unknown:
        raise SystemExit(f"--arms: unknown {unknown}; allowed: {', '.join(ARMS)}")
    import torch  # after the arguments: --help answers at once

    from crystal_grpo.train.benchmarks.training import command, summarise
    from crystal_grpo.train.capacity.estimate import ASSUMED_IMAGE, USABLE

    cuda = (a.device or ("cuda" if torch.cuda.is_available() else "cpu")) == "cuda"
    if a.model == "3b" and not cuda:
        raise SystemExit("--model 3b needs a CUDA GPU; --model tiny runs the same check on CPU")
    a.dtype, a.config = ("bfloat16" if cuda else "float32"), "tiny.yaml"
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")])),
    }
    model = build_model(a.model, REPO_ROOT / ".cache" / "models")
    if cuda:
        device, capacity = torch.cuda.get_device_name(), torch.cuda.get_device_properties(0).total_memory / GIB
    else:
        device, capacity = f"CPU ({os.cpu_count()} cores, {platform.machine()})", None
    image = ASSUMED_IMAGE if a.model == "3b" else SMALL_IMAGE
    rows_file = write_rows(a.out / "data", image)
    extra = ["--data.train", str(rows_file), "--training.gradient_checkpointing", "true"]
    print(
        f"GPU check on {device}, {time.strftime('%Y-%m-%d')}: {Path(model).name}, {a.dtype}, {a.batch} completions "
        f"x <= {a.completion_length} tokens, images {image[1]}x{image[0]}, "
        f"median of {a.steps} steps after {a.warmup}",
        flush=True,
    )
    rows: dict[str, dict] = {}
    skipped: dict[str, str] = {}
    for name in arms:
        out = a.out / name
        shutil.rmtree(out, ignore_errors=True)
        cmd = command(name, str(model), out, a, cuda) + extra
        predicted = predicted_gib(cmd)
        if capacity and predicted > USABLE * capacity and not a.force:
            skipped[name] = f"predicted {predicted:.1f} GiB > {USABLE:.0%} of {capacity:.0f} GiB (--force runs it)"
            print(f"  {name}: skipped, {skipped[name]}", file=sys.stderr, flush=True)
            continue
        proc = subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            print(proc.stdout[-3000:] + proc.stderr[-6000:], file=sys.stderr)
            raise SystemExit(f"{name}: exit {proc.returncode}")
        rows[name] = arm_row(name, summarise(out, a.warmup), predicted, a.batch)
        print(f"  {name}: step {rows[name]['step_s']:.2f} s", file=sys.stderr, flush=True)
    rows = with_trl_ratios(rows)
    report = {
        "device": device,
        "date": time.strftime("%Y-%m-%d"),
        "model": Path(model).name,
        "settings": {k: v for k, v in vars(a).items() if k not in ("out", "arms")},
        "arms": rows,
        "skipped": skipped,
    }
    (a.out / REPORT).write_text(json.dumps(report, indent=2, default=str))
    print(table(rows))
    print(f"report: {a.out / REPORT}")
    return 0

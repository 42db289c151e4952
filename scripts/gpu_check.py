#!/usr/bin/env python
"""The true-scale GPU check: Qwen2.5-VL-3B (random weights) under ZeRO-3, this framework against
plain TRL, LoRA and full fine-tuning; ``--model tiny`` runs the same check on CPU.

    python scripts/gpu_check.py [--model 3b|tiny|PATH] [--device cpu|cuda] [--steps 3] [--warmup 1]
        [--arms zero3-lora-pcgrad,trl-zero3-lora-cpr,...] [--batch 8] [--completion_length 256]
        [--encoder packaged:all-MiniLM-L6-v2|exact] [--force] [--out runs/gpu_check]

What it runs and prints: docs/benchmarks.md, "The true-scale GPU check".
"""

import sys
from pathlib import Path


def build_model(name: str, models: Path) -> Path:
    """The 3B model (built on the GPU on first use), the tests' tiny VLM, or the folder given."""
    from crystal_grpo.train.benchmarks.gpu_check import qwen25_vl_3b_config
    from crystal_grpo.train.fixtures import tiny_models

    if name == "3b":
        return tiny_models.build_random_vlm(models / "qwen2.5-vl-3b-random", qwen25_vl_3b_config, "cuda")
    if name == "tiny":
        return tiny_models.build_tiny_vlm(models / tiny_models.VLM_NAME)
    return Path(name)


def write_rows(folder: Path, size: tuple[int, int]) -> Path:
    """The shapes rows with their pictures at ``size`` (height, width)."""
    from crystal_grpo.train.fixtures import shapes

    return shapes.generate(folder, size=size)


if __name__ == "__main__":
    from crystal_grpo.train.benchmarks.gpu_check import main

    sys.exit(main(build_model, write_rows))

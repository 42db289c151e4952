#!/usr/bin/env python
"""The true-scale GPU check: Qwen2.5-VL-3B (random weights) under ZeRO-3, this framework against
plain TRL, LoRA and full fine-tuning; ``--model tiny`` runs the same check on CPU.

    python scripts/gpu_check.py [--model 3b|tiny] [--arms zero3-lora-pcgrad,trl-zero3-lora-cpr,...]
        [--steps 3] [--warmup 1] [--batch 8] [--completion_length 256] [--out runs/gpu_check]

What it runs and prints: docs/benchmarks.md, "The true-scale GPU check".
"""

import sys

from crystal_grpo.train.benchmarks.gpu_check import main

if __name__ == "__main__":
    sys.exit(main())

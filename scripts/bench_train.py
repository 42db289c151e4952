#!/usr/bin/env python
"""Benchmark GRPO training: this framework against plain TRL, LoRA against full fine-tuning,
DeepSpeed ZeRO-3 against one process (one table, every ratio measured in the same run).

    python scripts/bench_train.py [--model tiny|organism|mid|PATH] [--device cpu|cuda]
        [--settings trl-full,plain-full-answer,plain-full,plain-full-pcgrad,...] [--rounds 2]
        [--steps 5] [--warmup 2] [--batch 8] [--completion_length 128] [--threads N]

The logic lives in crystal_grpo.train.benchmarks.training; the settings, the models and the columns:
docs/benchmarks.md, "What bench_train.py runs and prints".
"""

import sys

from crystal_grpo.train.benchmarks.training import main

if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python
"""Benchmark PCGrad: GRPO step time and peak memory with PCGrad off and on, side by side, for full
fine-tuning and LoRA on the same tiny model; with ``--memory``, the bytes PCGrad allocates per
trainable parameter instead.

    python scripts/bench_pcgrad.py [--model .cache/models/tiny-qwen2] [--pairs 10] [--warmup 2]
                                   [--batch 8] [--completion_length 32] [--beta 0.04] [--threads N]
    python scripts/bench_pcgrad.py --memory [--baseline old_pcgrad.py] [--model ...]

The logic lives in crystal_grpo.train.benchmarks.pcgrad; the workload, the columns and the targets:
docs/benchmarks.md, "PCGrad step time" and "PCGrad memory".
"""

import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from crystal_grpo.train.benchmarks.pcgrad import main

if __name__ == "__main__":
    sys.exit(main())

"""Benchmark the batched Match-F1 scorer against a per-example loop (one table, one run).

    python scripts/bench_scorer.py [--encoder packaged:all-MiniLM-L6-v2] [--device cpu]
                                   [--sizes 64,256,1024] [--repeats 3]

The logic lives in crystal_grpo.train.benchmarks.scorer; the workload and the results:
docs/benchmarks.md, "Match-F1 scorer".
"""

import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from crystal_grpo.train.benchmarks.scorer import main

if __name__ == "__main__":
    sys.exit(main())

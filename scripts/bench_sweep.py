#!/usr/bin/env python
"""Benchmark how a sweep runs its points: one at a time against two at a time, each run a new
interpreter against forked from one that imported the libraries (one table, ratios measured in
the same run).

    python scripts/bench_sweep.py configs/sweeps/organism_ablation.yaml --point answer_only_seed1 \\
        --point cpr_seed1 --point answer_only_seed2 --point cpr_seed2 [--modes jobs1-spawn,jobs2-spawn,jobs2-fork]

The logic lives in crystal_grpo.train.benchmarks.launch_modes.
"""

import sys
from pathlib import Path

from crystal_grpo.train.benchmarks.launch_modes import main

if __name__ == "__main__":
    sys.exit(main(root=Path(__file__).resolve().parents[1]))

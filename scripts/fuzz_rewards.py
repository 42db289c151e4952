"""Fuzz every reward module with hostile completions and print what happened.

    python scripts/fuzz_rewards.py                 # 100,000 completions, seed 0, batches of 16
    python scripts/fuzz_rewards.py --n 2000 --seed 3 --batch 8

The logic lives in crystal_grpo.train.tools.fuzz_rewards; results: docs/rewards.md, "Hostile model output".
"""

import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from crystal_grpo.train.tools.fuzz_rewards import main

if __name__ == "__main__":
    sys.exit(main())

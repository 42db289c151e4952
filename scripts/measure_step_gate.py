#!/usr/bin/env python
"""Is the step encoder blind to wrong numbers, and does the step gate fix it? (docs/rewards.md)

    python scripts/measure_step_gate.py [--encoder packaged:all-MiniLM-L6-v2] [--pairs 2000] [--chains 2000]

The logic lives in crystal_grpo.train.organism.step_gate.
"""

import sys

from crystal_grpo.train.organism.step_gate import main

if __name__ == "__main__":
    sys.exit(main())

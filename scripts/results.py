#!/usr/bin/env python
"""An experiment's per-seed results and the tables the docs show from them (docs/experiments.md).

    python scripts/results.py collect docs/results/when_steps_hold.yaml   # CSV from the sweeps' run folders
    python scripts/results.py tables                                      # rewrite the docs' results blocks
    python scripts/results.py tables --check                              # exit 1 if a block differs

The logic lives in crystal_grpo.train.tools.results.
"""

import sys

from crystal_grpo.train.tools.results import main

if __name__ == "__main__":
    sys.exit(main())

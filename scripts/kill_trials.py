"""Kill a tiny run at random moments (and while saving, and after its last step), resume it,
and check the result is the uninterrupted run's, bit for bit; prints a table.

    python scripts/kill_trials.py --trials 20 --steps 12 --out runs/kill_trials

The logic lives in crystal_grpo.train.tools.kill_trials.
"""

import sys

from crystal_grpo.train.tools.kill_trials import main

if __name__ == "__main__":
    sys.exit(main())

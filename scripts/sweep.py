"""Run a sweep of train/grpo.py runs (reward ablations, weight sweeps) and report it.

    python scripts/sweep.py configs/sweeps/reward_ablation.yaml                 # every point, one after another
    python scripts/sweep.py configs/sweeps/reward_ablation.yaml --emit slurm    # an sbatch job array, a task a point
    python scripts/sweep.py configs/sweeps/reward_ablation.yaml --emit commands # one launch line a point
    python scripts/sweep.py configs/sweeps/reward_ablation.yaml --report        # aggregate what has finished
    python scripts/sweep.py configs/sweeps/tiny.yaml --output_dir /tmp/sw        # the sweep folder

The logic lives in crystal_grpo.train.tools.sweep (the report: crystal_grpo.train.tools.sweep_report).
"""

import sys

from crystal_grpo.train.tools.sweep import main

if __name__ == "__main__":
    sys.exit(main())

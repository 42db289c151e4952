"""Draw the training curves of a run folder: reward, Match F1, accuracy, format rate, KL, loss.

    python scripts/plot_run.py runs/demo [--out curves.png]
    python scripts/plot_run.py runs/demo/phase2-cpr

A multi-phase run folder is drawn on one axis of cumulative optimizer steps, with the
phase boundaries marked; one phase's folder is drawn alone.
"""

import argparse
import sys

from crystal_grpo.paths import user_path
from crystal_grpo.train.run.plot import plot_run

if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run_dir", type=user_path, help="a run folder: a multi-phase run's, or one phase's")
    ap.add_argument("--out", type=user_path, help="PNG to write (default: RUN_DIR/training_curves.png)")
    a = ap.parse_args()
    try:
        print(plot_run(a.run_dir, a.out))
    except FileNotFoundError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)

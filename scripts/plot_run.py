"""Draw reward, Match F1, accuracy and KL curves for any run folder.

    python scripts/plot_run.py runs/demo/phase2-cpr [--out curves.png]
"""

import argparse
import sys

from crystal_grpo.train.plot import plot_run

if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run_dir", help="a run folder (one phase's folder for a multi-phase run)")
    ap.add_argument("--out", help="PNG to write (default: RUN_DIR/training_curves.png)")
    a = ap.parse_args()
    try:
        print(plot_run(a.run_dir, a.out))
    except FileNotFoundError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)

"""Draw reward, Match F1, accuracy and KL curves for any run folder.

    python scripts/plot_run.py runs/demo [--out curves.png]
"""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from train.plot import plot_run  # noqa: E402

if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("run_dir")
    ap.add_argument("--out")
    a = ap.parse_args()
    print(plot_run(a.run_dir, a.out))

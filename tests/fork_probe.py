"""A program for tests/test_sweep.py's launch tests: prints what it found when it started."""

import json
import os
import sys

LIBRARIES_LOADED = "transformers" in sys.modules  # at import: a forked run finds them loaded, a new interpreter not


def main(argv: list[str]) -> int:
    import torch

    print(
        json.dumps(
            {
                "libraries_loaded": LIBRARIES_LOADED,
                "threads": torch.get_num_threads(),
                "argv": argv,
                "argv0": sys.argv[0],
                "cwd": os.getcwd(),
                "pid": os.getpid(),
            }
        )
    )
    return 3


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

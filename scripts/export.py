"""Export a run's checkpoint as a standalone Hugging Face folder (full, LoRA or DeepSpeed ZeRO).

    python scripts/export.py runs/cpr/checkpoint-2800 --out exports/cpr-2800 [--keep_adapter]
        [--dtype bfloat16] [--max_shard_size 5GB] [--overwrite] [--base_model PATH]

The logic lives in crystal_grpo.train.tools.export (its docstring says what each kind becomes).
Exit status: 0 exported and checked, 2 bad input (one line on stderr), 1 the export failed
(nothing was written to --out).
"""

import sys

from crystal_grpo.train.tools.export import main

if __name__ == "__main__":
    sys.exit(main())

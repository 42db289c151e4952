"""Reference steps for question/answer data: several generators solve each row, the correct
solutions' steps are clustered and the cluster medoids ordered into one chain (CRYSTAL
Sec. 3.1, docs/method.md section 11).

    python scripts/build_references.py --data my.jsonl --out my_with_refs.jsonl \
        --generator Qwen/Qwen2.5-VL-7B-Instruct --generator ./other-model --samples 4 \
        [--encoder ...] [--cluster_threshold T] [--min_support 2] [--keep_incorrect]
    python scripts/build_references.py --data my.jsonl --out my_with_refs.jsonl --trajectories a.jsonl b.jsonl

The pipeline lives in crystal_grpo.train.tools.build_references, the aggregation in
crystal_grpo.rewards.references. Exit status: 0 built, 1 some rows failed (the rest are
written), 2 bad input (one line on stderr).
"""

import sys

from crystal_grpo.train.tools.build_references import main

if __name__ == "__main__":
    sys.exit(main())

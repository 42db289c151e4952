"""Score a checkpoint, a run's phases, or a predictions file on a data set: accuracy, Match F1,
precision, recall, LIS ratio, Ordered F1, format rate, mean steps and the run's reward,
overall (with 95% bootstrap intervals), per source, complexity tier and step count.

    python scripts/evaluate.py --model runs/cpr/final --data data/wordproblems/val.jsonl --out eval/cpr
    python scripts/evaluate.py --run runs/cpr_curriculum            # every phase's best checkpoint
    python scripts/evaluate.py --predictions eval/cpr/predictions.jsonl --data ... --out ...
    python scripts/evaluate.py --compare eval/a eval/b
    accelerate launch scripts/evaluate.py ...                        # rows split over processes

The logic lives in crystal_grpo.train.tools.evaluate (generation: crystal_grpo.train.models.generation).
"""

import sys

from crystal_grpo.train.tools.evaluate import main

if __name__ == "__main__":
    sys.exit(main())

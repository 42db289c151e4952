#!/usr/bin/env python
"""Steps beside answers on the model organism, by variant (docs/experiments.md, "Diagnosis").

    python scripts/step_diagnosis.py --eval runs/x/eval_greedy runs/x/eval_t1 --data .cache/organism/data/test.jsonl
    python scripts/step_diagnosis.py --sweep configs/sweeps/organism_ablation.yaml

The logic lives in crystal_grpo.train.organism.step_diagnosis.
"""

import sys

from crystal_grpo.train.tools.ablation_figures import step_diagnosis_main as main

if __name__ == "__main__":
    sys.exit(main())

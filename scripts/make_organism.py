#!/usr/bin/env python
"""Build the model organism: the task's data splits and a from-scratch policy.

    python scripts/make_organism.py                          # .cache/organism/{data,model}
    python scripts/make_organism.py --error_rate 0.3         # demonstrations with slips (data/sft.jsonl)
    python scripts/make_organism.py --help                   # every knob

The logic lives in crystal_grpo.train.organism.task (the task) and
crystal_grpo.train.organism.make (tokenizer and policy).
"""

import sys

from crystal_grpo.train.organism.make import main

if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python
"""Write the word-problem data sets (docs/method.md section 1 rows).

    python scripts/make_data.py                      # writes data/wordproblems/{train,val}.jsonl
    python scripts/make_data.py --out-dir /tmp/wp    # same bytes elsewhere
    python scripts/make_data.py --preset demo        # writes data/demo/{train,val,test}.jsonl

The logic lives in crystal_grpo.train.fixtures.wordproblems.
"""

import sys

from crystal_grpo.train.fixtures.wordproblems import main

if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python
"""Build the tiny random-weight test models from configs (no hub access).

    python scripts/make_tiny_models.py [OUT_DIR]      # default .cache/models/{tiny-qwen2,tiny-qwen2.5-vl}

The logic lives in crystal_grpo.train.fixtures.tiny_models.
"""

import sys

from crystal_grpo.train.fixtures.tiny_models import main

if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python
"""Write the small vision set (coloured shapes drawn with PIL).

    python scripts/make_shapes.py                     # data/shapes/shapes.jsonl + data/shapes/images/*.png
    python scripts/make_shapes.py --out-dir /tmp/sh   # same bytes elsewhere

The logic lives in crystal_grpo.train.fixtures.shapes.
"""

import sys

from crystal_grpo.train.fixtures.shapes import main

if __name__ == "__main__":
    sys.exit(main())

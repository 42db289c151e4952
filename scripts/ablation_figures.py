#!/usr/bin/env python
"""Figures of a finished reward ablation: reasoning collapse, PCGrad, curriculum, the control arm.

    python scripts/ablation_figures.py configs/sweeps/organism_ablation.yaml

Writes collapse.png, pcgrad.png, curriculum.png, vs_control.md and pcgrad_summary.json into the
sweep folder (logic: crystal_grpo.train.tools.ablation_figures).
"""

import sys

from crystal_grpo.train.tools.ablation_figures import main

if __name__ == "__main__":
    sys.exit(main())

"""Tools built on a training run: evaluation and its report, export, sweeps and their report,
reference building, the training benchmark, kill trials and the statistics they share.

They import the core (``crystal_grpo.train``: config, data, models, trainer, checkpoints,
layout, generation, predictions), never the other way round; ``tests/test_architecture.py``
enforces it.
"""

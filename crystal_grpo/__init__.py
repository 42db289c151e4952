"""crystal-grpo: GRPO with CRYSTAL's step-level rewards on TRL.

The installed packages map the repository's folders: ``crystal_grpo.train`` (train/),
``crystal_grpo.rewards`` (rewards/) and ``crystal_grpo.curricula`` (curricula/).
"""

__version__ = "0.1.0"

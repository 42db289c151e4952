"""Step-level rewards: the Match-F1 scorer and the reward modules TRL calls."""

from rewards.match_f1 import PACKAGED_MINILM, PAPER_ENCODER, MatchF1Scorer, StepScores

__all__ = ["MatchF1Scorer", "StepScores", "PACKAGED_MINILM", "PAPER_ENCODER"]

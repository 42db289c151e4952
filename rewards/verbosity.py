"""Verbosity guard (CRYSTAL S6.3): stop the policy from padding its reasoning.

A step reward invites listing ever more steps to raise recall. The guard keeps a running median
M of predicted step counts over the last ``window`` completions that have steps and penalises
completions with more than ``k * M`` steps; it acts only once the window holds ``min_history``
counts and M > 0, and judges a batch by the window as it was before the batch. Why these
choices, which the paper leaves open: docs/method.md section 6, "Verbosity guard".
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


@dataclass
class VerbosityGuard:
    k: float = 2.0
    window: int = 1024
    factor: float = 0.5
    min_history: int = 64
    history: deque = field(default_factory=deque, repr=False)

    def __post_init__(self) -> None:
        if self.k <= 0 or self.window <= 0 or not 0.0 <= self.factor <= 1.0 or not 0 < self.min_history <= self.window:
            raise ValueError(
                f"verbosity guard: need k > 0, window > 0, 0 <= factor <= 1 and 0 < min_history <= window (got {self})"
            )
        self.history = deque((c for c in self.history if c > 0), maxlen=self.window)

    def median(self) -> float | None:
        """Median step count of the window, or None while it holds fewer than ``min_history``."""
        if len(self.history) < self.min_history:
            return None
        return float(statistics.median_low(self.history))  # the lower middle, as torch.median

    def step(self, n_steps: torch.Tensor) -> torch.Tensor:
        """Flag this batch's over-long completions, then add their step counts to the window.

        Returns a bool mask. Call once per generation batch, with the global batch's counts.
        """
        counts = [int(x) for x in n_steps.tolist()]
        median = self.median()
        limit = self.k * median if median is not None and median > 0 else math.inf  # none yet: flag nothing
        flagged = n_steps.double() > limit
        self.history.extend(c for c in counts if c > 0)
        return flagged

    def apply(self, component: torch.Tensor, flagged: torch.Tensor) -> torch.Tensor:
        """Penalise flagged rows by ``(1 - factor) * |r|``.

        For a non-negative reward this is exactly the paper's "multiply by 0.5". For a
        negative component (the composite's batch-normalised F1) multiplying by 0.5 would
        *raise* the reward of a verbose completion; subtracting the magnitude keeps the
        guard a penalty in every case. (Deliberate deviation from docs/method.md section 6.)
        """
        penalty = (1.0 - self.factor) * component.abs()
        return (component - penalty).where(flagged, component)

    def state_dict(self) -> dict:
        return {
            "k": self.k,
            "window": self.window,
            "factor": self.factor,
            "min_history": self.min_history,
            "history": list(self.history),
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore the window; settings stay as configured (like k, window and factor).

        States saved before the window skipped step-less completions hold zeros: they are
        dropped, since they are exactly what made the median collapse.
        """
        self.history = deque((int(c) for c in state.get("history", []) if int(c) > 0), maxlen=self.window)

"""Verbosity guard (CRYSTAL S6.3): stop the policy from padding its reasoning.

A step reward invites listing ever more steps to raise recall. The guard keeps a
running median M of predicted step counts over the last ``window`` completions and
penalises completions with more than ``k * M`` steps.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import torch


@dataclass
class VerbosityGuard:
    k: float = 2.0
    window: int = 1024
    factor: float = 0.5
    history: deque = field(default_factory=deque, repr=False)

    def __post_init__(self) -> None:
        if self.k <= 0 or self.window <= 0 or not 0.0 <= self.factor <= 1.0:
            raise ValueError(f"verbosity guard: need k > 0, window > 0, 0 <= factor <= 1 (got {self})")
        self.history = deque(self.history, maxlen=self.window)

    def median(self) -> float | None:
        if not self.history:
            return None
        return float(torch.tensor(list(self.history), dtype=torch.float64).median())

    def step(self, n_steps: torch.Tensor) -> torch.Tensor:
        """Flag this batch's over-long completions, then add their counts to the window.

        The median is taken over the window *before* this batch (over this batch itself
        when the window is still empty), so one verbose batch cannot excuse itself.
        Returns a bool mask. Call once per generation batch, with the global batch's counts.
        """
        counts = [int(x) for x in n_steps.tolist()]
        median = self.median()
        if median is None:
            median = float(n_steps.double().median()) if counts else 0.0
        flagged = n_steps.double() > self.k * median
        self.history.extend(counts)
        return flagged

    def apply(self, component: torch.Tensor, flagged: torch.Tensor) -> torch.Tensor:
        """Penalise flagged rows by ``(1 - factor) * |r|``.

        For a non-negative reward this is exactly the paper's "multiply by 0.5". For a
        negative component (the composite's batch-normalised F1) multiplying by 0.5 would
        *raise* the reward of a verbose completion; subtracting the magnitude keeps the
        guard a penalty in every case. (Deliberate deviation from SPEC section 6.)
        """
        penalty = (1.0 - self.factor) * component.abs()
        return torch.where(flagged, component - penalty, component)

    def state_dict(self) -> dict:
        return {"k": self.k, "window": self.window, "factor": self.factor, "history": list(self.history)}

    def load_state_dict(self, state: dict) -> None:
        self.history = deque(state.get("history", []), maxlen=self.window)

"""The non-finite guard: an update whose gradients are not finite is skipped, and too many in a row stop the run.

One NaN or Inf gradient (an overflow in bf16, a degenerate batch) written into the weights
ruins every later step. The guard wraps the optimizer's ``step``: when any gradient, on any
process, is not finite, the gradients are dropped and the update is skipped (logged as
``nonfinite_skipped_total``); after ``max_consecutive_nonfinite`` skips in a row the trainer
saves a checkpoint and stops (the run says how to resume). The count of skipped updates
travels with every checkpoint (``crystal_state.json``, train/trainer/checkpoint_hooks.py).
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from transformers import TrainerCallback

from crystal_grpo.distributed import all_ranks

logger = logging.getLogger(__name__)


class NonFiniteGuard(TrainerCallback):
    """Wraps the optimizer (:meth:`wrap`); as a callback, it asks the trainer to save and stop once
    ``max_consecutive`` updates in a row were skipped."""

    def __init__(self, max_consecutive: int = 5) -> None:
        self.max_consecutive = max_consecutive
        self.skipped = 0  #: updates skipped in the whole run (a checkpoint's part)
        self.consecutive = 0
        self.stopped = False
        self._optimizer: Any = None

    def wrap(self, optimizer: Any, device: Any) -> None:
        """Guard ``optimizer.step`` (once per optimizer, however often the trainer asks)."""
        if optimizer is self._optimizer:
            return
        self._optimizer, step = optimizer, optimizer.step

        def guarded_step(*args: Any, **kwargs: Any):
            if self.finite(optimizer, device):
                self.consecutive = 0
                return step(*args, **kwargs)
            optimizer.zero_grad(set_to_none=True)
            self.skipped += 1
            self.consecutive += 1
            self.stopped = self.stopped or self.consecutive >= self.max_consecutive
            return None

        optimizer.step = guarded_step

    @staticmethod
    def finite(optimizer: Any, device: Any) -> bool:
        """All ranks agree: under ZeRO each rank only sees its own gradient partition."""
        grads = [p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
        if not grads:
            ok = torch.ones((), device=device)
        else:  # reduced on the device: one host sync a step (``.item()`` in all_ranks), not one per parameter
            at = grads[0].device
            ok = torch.stack([torch.isfinite(g).all().to(at) for g in grads]).all().float()
        return all_ranks(ok)

    def on_optimizer_step(self, args, state, control, **kwargs):
        if self.consecutive:  # this step's update was skipped
            logger.warning(
                "non-finite gradients at step %d: update skipped (%d in a row)", state.global_step, self.consecutive
            )
        if self.stopped:
            control.should_save = True
            control.should_training_stop = True
        return control

    def logs(self) -> dict[str, float]:
        return {"nonfinite_skipped_total": float(self.skipped)}

    def state_dict(self) -> int:
        return self.skipped

    def load_state_dict(self, skipped: int) -> None:
        self.skipped = skipped

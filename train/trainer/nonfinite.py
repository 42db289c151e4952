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

from crystal_grpo.distributed import all_ranks

logger = logging.getLogger(__name__)


class NonFiniteGuardMixin:
    """``create_optimizer`` with the guard (module docstring); ``log`` adds ``nonfinite_skipped_total``.
    Before :class:`~crystal_grpo.train.trainer.checkpoint_hooks.CheckpointMixin` in the bases (its count
    joins the checkpoint state; tests/test_trl_contract.py checks the order)."""

    def __init__(self, *args: Any, max_consecutive_nonfinite: int = 5, **kwargs: Any) -> None:
        self.max_consecutive_nonfinite = max_consecutive_nonfinite
        self.nonfinite_skipped = 0
        self.consecutive_nonfinite = 0
        self.stopped_nonfinite = False
        super().__init__(*args, **kwargs)

    def create_optimizer(self, model=None):
        optimizer = super().create_optimizer(model) if model is not None else super().create_optimizer()
        if not getattr(optimizer, "_crystal_guarded", False):
            step = optimizer.step

            def guarded_step(*args: Any, **kwargs: Any):
                if self._grads_finite(optimizer):
                    self.consecutive_nonfinite = 0
                    return step(*args, **kwargs)
                self._skip_update(optimizer)
                return None

            optimizer.step = guarded_step
            optimizer._crystal_guarded = True
        return optimizer

    def _grads_finite(self, optimizer) -> bool:
        """All ranks agree: under ZeRO each rank only sees its own gradient partition."""
        grads = [p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
        if not grads:
            ok = torch.ones((), device=self.accelerator.device)
        else:  # reduced on the device: one host sync a step (``.item()`` in all_ranks), not one per parameter
            device = grads[0].device
            ok = torch.stack([torch.isfinite(g).all().to(device) for g in grads]).all().float()
        return all_ranks(ok)

    def _skip_update(self, optimizer) -> None:
        optimizer.zero_grad(set_to_none=True)
        self.nonfinite_skipped += 1
        self.consecutive_nonfinite += 1
        self._metrics["train"]["nonfinite_skipped"].append(1.0)
        logger.warning(
            "non-finite gradients at step %d: update skipped (%d in a row)",
            self.state.global_step,
            self.consecutive_nonfinite,
        )
        if self.consecutive_nonfinite >= self.max_consecutive_nonfinite:
            self.stopped_nonfinite = True
            self.control.should_save = True
            self.control.should_training_stop = True

    def crystal_state(self) -> dict:
        return {"nonfinite_skipped": self.nonfinite_skipped, **super().crystal_state()}

    def load_crystal_state(self, state: dict) -> None:
        super().load_crystal_state(state)
        self.nonfinite_skipped = state.get("nonfinite_skipped", 0)

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        if self.model.training:
            logs["nonfinite_skipped_total"] = float(self.nonfinite_skipped)
            self._metrics["train"].pop("nonfinite_skipped", None)
        super().log(logs, start_time)

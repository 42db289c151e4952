"""The trainer's side of train/run/checkpoints.py: complete checkpoints, our state in them, and resuming.

- ``_save_checkpoint``: checked against the free disk space first (the previous checkpoint's
  size), the completion marker removed before and written after every rank saved, so an
  interrupted save is never resumed from; a save that fills the disk removes its partial folder.
- ``crystal_state.json`` (``crystal_state``): what travels with a checkpoint besides HF's own
  state: the optimizer settings, and each concept's own part (the non-finite count, the
  reward module's state), restored by ``_load_optimizer_and_scheduler``, which also sets the
  learning rate to what this run's schedule gives at the restored step (:func:`continue_schedule`).
- ``train(resume_from_checkpoint="latest" | True)``: the newest *complete* checkpoint.
- ``finish_from``: end a phase whose checkpoint already holds its last step, without a step.
- ``_issue_warnings_after_load``: a resumed model's tied ``lm_head`` is not reported missing.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from typing import Any

import torch
from transformers import TrainerCallback

from crystal_grpo.distributed import all_ranks
from crystal_grpo.train.run.checkpoints import (
    DiskFull,
    checkpoint_bytes,
    checkpoint_files,
    disk_full,
    has_room,
    optimizer_settings,
    remove_marker,
    resolve_resume,
    space_report,
    write_marker,
)
from crystal_grpo.train.run.layout import STATE_FILE, checkpoint_name

logger = logging.getLogger(__name__)


def continue_schedule(optimizer: Any, scheduler: Any) -> tuple[int, float, float] | None:
    """Set each parameter group's learning rate to what ``scheduler`` gives at its restored step;
    returns (the step, the first group's saved rate, its rate now) where they differed, else None.

    transformers restores the optimizer's rates as saved but builds the schedule for this run's
    ``max_steps``: with another ``max_steps`` (or schedule) the first step after a resume trained
    at the saved rate (0 at the end of a linear schedule) and the next ones on the new schedule.
    Schedules that are not a ``LambdaLR`` (ReduceLROnPlateau) keep their saved rates."""
    sched = getattr(scheduler, "scheduler", scheduler)  # (accelerate's wrapper)
    if not isinstance(sched, torch.optim.lr_scheduler.LambdaLR):
        return None
    planned = [base * fn(sched.last_epoch) for base, fn in zip(sched.base_lrs, sched.lr_lambdas)]
    groups = optimizer.param_groups
    saved = [float(g["lr"]) for g in groups]
    if saved == planned:
        return None
    for group, lr in zip(groups, planned):
        group["lr"] = lr
    sched._last_lr = list(planned)  # what get_last_lr() (the logged learning_rate) reads, as step() sets it
    return sched.last_epoch, saved[0], planned[0]


class _BeforeFirstStep(Exception):
    """Raised by :class:`_StopBeforeFirstStep` once a checkpoint is loaded (``finish_from``)."""


class _StopBeforeFirstStep(TrainerCallback):
    def on_train_begin(self, args, state, control, **kwargs):
        raise _BeforeFirstStep


class CheckpointMixin:
    """Checkpoints with a completion marker and our state, and resuming (module docstring).
    ``crystal_state`` / ``load_crystal_state`` end here: a mixin before this one in the bases
    adds its part and calls ``super()``."""

    def crystal_state(self) -> dict:
        """What travels with a checkpoint besides HF's own state (``crystal_state.json``)."""
        return {"settings": optimizer_settings(self.optimizer, self.lr_scheduler)}

    def load_crystal_state(self, state: dict) -> None:
        """Restore a checkpoint's ``crystal_state.json`` (each mixin its own part)."""

    def _save_checkpoint(self, model, trial):
        run_dir = self._get_output_dir(trial=trial)
        folder = os.path.join(run_dir, checkpoint_name(self.state.global_step))
        need = checkpoint_bytes(run_dir)  # the previous checkpoint's size: this one's, to the byte or so
        if not all_ranks(has_room(run_dir, need, checkpoint_files(run_dir)), self.accelerator.device):
            raise DiskFull(f"not saving {folder}: {space_report(run_dir, need)}")
        if self.args.should_save:
            remove_marker(folder)  # a folder being (re)written is incomplete until the end
        self.accelerator.wait_for_everyone()  # before any rank overwrites its shards
        try:
            super()._save_checkpoint(model, trial)
            if self.args.should_save:
                with open(os.path.join(folder, STATE_FILE), "w") as fh:
                    json.dump(self.crystal_state(), fh)
        except (OSError, RuntimeError) as err:
            if disk_full(err, run_dir) is None:
                raise
            if self.args.should_save:  # never resumable (no marker): give its space back
                shutil.rmtree(folder, ignore_errors=True)
            raise DiskFull(
                f"saving {folder} failed ({disk_full(err, run_dir)}); the partial folder was removed"
            ) from None
        self.accelerator.wait_for_everyone()  # every rank's shards are on disk
        if self.args.should_save:
            write_marker(folder, self.state.global_step)

    def _load_optimizer_and_scheduler(self, checkpoint):
        super()._load_optimizer_and_scheduler(checkpoint)
        path = os.path.join(checkpoint, STATE_FILE) if checkpoint else None
        if path and os.path.exists(path):
            with open(path) as fh:
                self.load_crystal_state(json.load(fh))
        changed = continue_schedule(self.optimizer, self.lr_scheduler) if checkpoint else None
        if changed and self.accelerator.is_main_process:
            (step, saved, now), kind = changed, self.args.lr_scheduler_type
            logger.warning(
                "resumed at step %d on a learning-rate schedule other than the checkpoint's (lr_scheduler_type %s, "
                "max_steps %s): transformers plans it over the whole run from step 0, so step %d trains at %.6g, "
                "not at the checkpoint's %.6g; for a constant rate from here use lr_scheduler_type constant",
                step,
                getattr(kind, "value", kind),
                self.args.max_steps,
                step + 1,
                now,
                saved,
            )

    def finish_from(self, checkpoint: str) -> None:
        """End a phase whose ``checkpoint`` already holds its last step: load it (weights,
        state) and run the end-of-training callbacks (final validation, plot) without a step.
        HF's loop always trains one step after resuming, even at ``max_steps``, which would
        train a finished run past its end."""
        stop = _StopBeforeFirstStep()
        self.add_callback(stop)  # last: every other callback has seen on_train_begin
        try:
            self.train(resume_from_checkpoint=checkpoint)
        except _BeforeFirstStep:
            pass
        finally:
            self.remove_callback(stop)
        self.control = self.callback_handler.on_train_end(self.args, self.state, self.control)

    def train(self, resume_from_checkpoint: str | bool | None = None, *args: Any, **kwargs: Any):
        """``True`` or ``"latest"`` resume from the newest *complete* checkpoint of ``output_dir``
        (HF's own ``True`` takes the newest folder, complete or not); none yet: a fresh start."""
        if resume_from_checkpoint is True or resume_from_checkpoint == "latest":
            resume_from_checkpoint = resolve_resume(self.args.output_dir, "latest")
        return super().train(resume_from_checkpoint, *args, **kwargs)

    def _issue_warnings_after_load(self, load_result: Any) -> None:
        """A resumed checkpoint has no ``lm_head.weight`` when it is tied to the embeddings (it is
        saved once): expected, so not reported as missing; every other missing key still is."""
        params = dict(self.model.named_parameters(remove_duplicate=False))
        missing = set(load_result.missing_keys)
        storage = {p.data_ptr() for name, p in params.items() if name not in missing and p.numel()}
        tied = [k for k in missing if k in params and params[k].numel() and params[k].data_ptr() in storage]
        if tied:
            self.model.tie_weights()
            load_result = load_result._replace(missing_keys=[k for k in load_result.missing_keys if k not in tied])
        super()._issue_warnings_after_load(load_result)

"""The trainer's side of train/run/checkpoints.py: complete checkpoints, our state in them, and resuming.

- :func:`complete_checkpoint`: a save checked against the free disk space first (the previous
  checkpoint's size), the completion marker removed before and written after every rank saved, so an
  interrupted save is never resumed from; a save that fills the disk removes its partial folder.
- :class:`CheckpointState`: what travels with a checkpoint besides HF's own state
  (``crystal_state.json``): each part under its key, registered by the object that keeps it (the
  optimizer settings, the non-finite count, the reward module's state), and restored by it.
- :func:`continue_schedule`: a resumed run's learning rate is what this run's schedule gives at the
  restored step.
- :func:`tied_keys_found`: a resumed model's tied ``lm_head`` is not reported missing.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
from collections.abc import Callable, Iterator
from typing import Any

import torch

from crystal_grpo.distributed import all_ranks
from crystal_grpo.train.run.checkpoints import (
    DiskFull,
    checkpoint_bytes,
    checkpoint_files,
    disk_full,
    has_room,
    remove_marker,
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


def schedule_warning(changed: tuple[int, float, float] | None, args: Any) -> str | None:
    """What a resume says when :func:`continue_schedule` moved the learning rate (None: it did not)."""
    if not changed:
        return None
    (step, saved, now), kind = changed, args.lr_scheduler_type
    return (
        f"resumed at step {step} on a learning-rate schedule other than the checkpoint's (lr_scheduler_type "
        f"{getattr(kind, 'value', kind)}, max_steps {args.max_steps}): transformers plans it over the whole run "
        f"from step 0, so step {step + 1} trains at {now:.6g}, not at the checkpoint's {saved:.6g}; for a "
        "constant rate from here use lr_scheduler_type constant"
    )


class CheckpointState:
    """What travels with a checkpoint besides HF's own state (``crystal_state.json``): each part under
    its key, saved by its ``save`` and restored by its ``load`` (None: written for the record only)."""

    def __init__(self) -> None:
        self.parts: dict[str, tuple[Callable[[], Any], Callable[[Any], None] | None]] = {}

    def register(self, key: str, save: Callable[[], Any], load: Callable[[Any], None] | None = None) -> None:
        self.parts[key] = (save, load)

    def write(self, folder: str) -> None:
        with open(os.path.join(folder, STATE_FILE), "w") as fh:
            json.dump({key: save() for key, (save, _) in self.parts.items()}, fh)

    def read(self, checkpoint: str) -> None:
        """Restore each part a checkpoint holds (an older checkpoint may lack some)."""
        path = os.path.join(checkpoint, STATE_FILE)
        if not os.path.exists(path):
            return
        with open(path) as fh:
            state = json.load(fh)
        for key, (_, load) in self.parts.items():
            if load is not None and key in state:
                load(state[key])


@contextlib.contextmanager
def complete_checkpoint(run_dir: str, step: int, accelerator: Any, should_save: bool) -> Iterator[str]:
    """Around one checkpoint's save into ``run_dir`` (every rank): yields its folder; the disk is
    checked first, the completion marker is removed before and written after every rank saved, and
    a save that fills the disk removes its partial folder and says so."""
    folder = os.path.join(run_dir, checkpoint_name(step))
    need = checkpoint_bytes(run_dir)  # the previous checkpoint's size: this one's, to the byte or so
    if not all_ranks(has_room(run_dir, need, checkpoint_files(run_dir)), accelerator.device):
        raise DiskFull(f"not saving {folder}: {space_report(run_dir, need)}")
    if should_save:
        remove_marker(folder)  # a folder being (re)written is incomplete until the end
    accelerator.wait_for_everyone()  # before any rank overwrites its shards
    try:
        yield folder
    except (OSError, RuntimeError) as err:
        if disk_full(err, run_dir) is None:
            raise
        if should_save:  # never resumable (no marker): give its space back
            shutil.rmtree(folder, ignore_errors=True)
        raise DiskFull(f"saving {folder} failed ({disk_full(err, run_dir)}); the partial folder was removed") from None
    accelerator.wait_for_everyone()  # every rank's shards are on disk
    if should_save:
        write_marker(folder, step)


def tied_keys_found(model: Any, load_result: Any) -> Any:
    """``load_result`` without the missing keys of weights tied to a loaded one (a resumed checkpoint has
    no ``lm_head.weight`` when it is tied to the embeddings: it is saved once), whose ties are made
    again; every other missing key is still reported."""
    params = dict(model.named_parameters(remove_duplicate=False))
    missing = set(load_result.missing_keys)
    storage = {p.data_ptr() for name, p in params.items() if name not in missing and p.numel()}
    tied = [k for k in missing if k in params and params[k].numel() and params[k].data_ptr() in storage]
    if not tied:
        return load_result
    model.tie_weights()
    return load_result._replace(missing_keys=[k for k in load_result.missing_keys if k not in tied])

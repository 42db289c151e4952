"""Ctrl-C and a scheduler's SIGTERM: finish the current step, save, stop; a second one aborts.

Without this, SIGINT kills training mid-step (possibly mid-save) and SIGTERM, which
SLURM and Kubernetes send before they kill a job, loses everything since the last
periodic checkpoint. The first signal only sets a flag; at the end of the optimizer
step every rank agrees (one tiny all-reduce, so all ranks stop at the same step even when
the signal reached them at different moments), the trainer saves a checkpoint and stops.
Under torchrun / accelerate launch the launcher forwards the signal to the workers and
kills them after ``TORCH_ELASTIC_SHUTDOWN_TIMEOUT`` seconds (default 30): set it above one
step plus one save for long steps.
"""

from __future__ import annotations

import contextlib
import signal
import sys
import time
from collections.abc import Iterator

import torch
from transformers import TrainerCallback

from crystal_grpo.distributed import is_main_process, rank_and_world
from crystal_grpo.signals import routed

#: Signals this close together count as one: a terminal's Ctrl-C reaches every process of
#: a torchrun / accelerate job AND is forwarded to the workers by the launcher.
SAME_INTERRUPT_S = 1.0


class Interrupted(Exception):
    """Training stopped on a signal after saving ``checkpoint``; exit code 128 + signal."""

    def __init__(self, signum: int, step: int, checkpoint: str | None) -> None:
        self.signum, self.step, self.checkpoint = signum, step, checkpoint
        super().__init__(f"{signal.Signals(signum).name} at step {step}")

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


class GracefulStop(TrainerCallback):
    """Install with :meth:`handling`; the trainer stops (and saves) at the next step end."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self.stopped_at: int | None = None
        self._first_at = 0.0

    def _handler(self, signum, frame) -> None:
        now = time.monotonic()
        if self.signum is not None:
            if now - self._first_at < SAME_INTERRUPT_S:
                return  # one Ctrl-C delivered twice: by the terminal and forwarded by torchrun
            raise KeyboardInterrupt  # a second interrupt: abort now
        self.signum, self._first_at = signum, now
        if is_main_process():  # (torchrun forwards the signal to every worker)
            print(
                f"\n{signal.Signals(signum).name} received: finishing this step, then saving a checkpoint and "
                "stopping (press Ctrl-C again to abort at once)",
                file=sys.stderr,
                flush=True,
            )

    @contextlib.contextmanager
    def handling(self) -> Iterator[GracefulStop]:
        """Route SIGINT/SIGTERM to this object for the duration (main thread only)."""
        with routed(self._handler):
            yield self

    def _agreed_signal(self, device) -> int:
        """The signal any rank received (0: none); collective, so every rank calls it."""
        mine = self.signum or 0
        if rank_and_world()[1] == 1:
            return mine
        flag = torch.tensor([mine], dtype=torch.int64, device=device)
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
        return int(flag.item())

    def on_step_end(self, args, state, control, **kwargs):
        signum = self._agreed_signal(args.device)
        if signum and self.stopped_at is None:
            self.signum = signum
            self.stopped_at = state.global_step
            control.should_save = True
            control.should_training_stop = True
        return control

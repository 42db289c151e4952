"""SIGINT, SIGTERM and SIGHUP routed to a handler for a while: the training run's graceful stop
(train/trainer/interrupt.py) and the sweep's (train/tools/launch.py)."""

from __future__ import annotations

import contextlib
import os
import signal
import stat
import threading
from collections.abc import Callable, Iterator

#: Ctrl-C, what a scheduler (SLURM, Kubernetes) sends before it kills a job, and what a closed
#: terminal or a dropped ssh connection sends: each stops at the end of the step, after a save.
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


@contextlib.contextmanager
def routed(handler: Callable) -> Iterator[None]:
    """The :data:`STOP_SIGNALS` go to ``handler`` inside, the previous handlers come back after. A
    SIGHUP that is ignored (``nohup``) stays ignored; on a SIGHUP the terminal is gone, so the
    process's terminal output goes to /dev/null first (a write to a hung-up terminal fails, and
    would stop the run mid-step instead). Python sets handlers only in the main thread: elsewhere
    this is a no-op."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    wanted = [s for s in STOP_SIGNALS if not (s == signal.SIGHUP and signal.getsignal(s) == signal.SIG_IGN)]

    def hung_up(signum, frame) -> None:
        detach_terminal()
        handler(signum, frame)

    previous = {s: signal.signal(s, hung_up if s == signal.SIGHUP else handler) for s in wanted}
    try:
        yield
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


def detach_terminal() -> None:
    """Point standard output and error that are a terminal (a character device other than
    /dev/null: a hung-up one no longer answers ``isatty``) at /dev/null; files and pipes stay."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        null = os.fstat(devnull).st_rdev
        for fd in (1, 2):
            with contextlib.suppress(OSError):
                st = os.fstat(fd)
                if stat.S_ISCHR(st.st_mode) and st.st_rdev != null:
                    os.dup2(devnull, fd)
    finally:
        os.close(devnull)

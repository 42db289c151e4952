"""SIGINT and SIGTERM routed to a handler for a while: the training run's graceful stop
(train/trainer/interrupt.py) and the sweep's (train/tools/launch.py)."""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Callable, Iterator

#: Ctrl-C, and what a scheduler (SLURM, Kubernetes) sends before it kills a job.
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


@contextlib.contextmanager
def routed(handler: Callable) -> Iterator[None]:
    """SIGINT and SIGTERM go to ``handler`` inside, the previous handlers come back after. Python sets
    handlers only in the main thread: elsewhere this is a no-op."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {s: signal.signal(s, handler) for s in STOP_SIGNALS}
    try:
        yield
    finally:
        for s, h in previous.items():
            signal.signal(s, h)

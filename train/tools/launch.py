"""How a sweep runs its programs (train/grpo.py, scripts/evaluate.py): in a child forked from one
process that has imported them, where it can, else as a subprocess.

A run imports torch, transformers, TRL, DeepSpeed and matplotlib before its first step, seconds
of CPU a run, and an organism point runs three times (its training and two evaluations:
docs/benchmarks.md, "A sweep point's wall time"). Python's forkserver imports them once a sweep
(:data:`PRELOAD`); each run is a child forked from it: a process of its own (pid, log, signals,
exit code) that finds the modules loaded, and computes what the same command line in a new
interpreter computes (tests/test_sweep.py compares the weights bit for bit). Not where CUDA is
visible: the CUDA driver does not survive a fork, so GPU sweeps keep subprocesses.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import importlib
import multiprocessing
import multiprocessing.forkserver
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from crystal_grpo.signals import routed

#: What a training run and an evaluation import, loaded once into the fork server.
PRELOAD = (
    "crystal_grpo.train.grpo",
    "crystal_grpo.train.trainer.grpo_trainer",
    "crystal_grpo.train.pcgrad.trainer",
    "crystal_grpo.train.trainer.callbacks",
    "crystal_grpo.train.trainer.interrupt",
    "crystal_grpo.train.models.loading",
    "crystal_grpo.train.data.splits",
    "crystal_grpo.train.run.plot",
    "crystal_grpo.train.tools.evaluate",
    "crystal_grpo.train.tools.eval_report",
    "deepspeed",
    "matplotlib.pyplot",
)


@dataclass(frozen=True)
class Entry:
    """A program of the sweep: a checkout's script, else the installed package's module."""

    script: str
    module: str

    def argv(self, root: Path) -> list[str]:
        """What follows the interpreter (``accelerate launch -m`` takes a module too)."""
        return [self.script] if (root / self.script).is_file() else ["-m", self.module]


_LOCK = threading.Lock()
_RUNNING: set[int] = set()  # pids of the runs going on (several with --jobs)

TRAIN = Entry("train/grpo.py", "crystal_grpo.train.grpo")
EVALUATE = Entry("scripts/evaluate.py", "crystal_grpo.train.tools.evaluate")


@dataclass(frozen=True)
class Settings:
    """How the runs start: their torch threads (None: as the environment sets them), and whether
    they may be forked (False: each a new interpreter, as ``--no_fork`` asks)."""

    threads: int | None = None
    fork: bool = True


@functools.cache
def can_fork() -> bool:
    """A fork server exists here (POSIX) and no CUDA device is visible."""
    import torch

    return "forkserver" in multiprocessing.get_all_start_methods() and not torch.cuda.is_available()


@functools.cache
def _context():
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(list(PRELOAD))
    return ctx


def run(
    entry: Entry,
    args: list[str],
    log: Path,
    root: Path,
    launcher: list[str] | None = None,
    settings: Settings = Settings(),
) -> int:
    """Run ``entry`` with ``args`` in ``root`` to its end, its output appended to ``log``; its exit
    code. ``launcher`` (e.g. ``accelerate launch ...``) always takes a subprocess. On Ctrl-C the run
    gets SIGINT too (it saves a checkpoint at its step's end and stops: train/trainer/interrupt.py), and
    KeyboardInterrupt is raised once it has stopped."""
    threads = settings.threads
    if launcher is None and settings.fork and can_fork():
        proc = _context().Process(target=_child, args=(entry, args, str(log), str(root), threads, os.getpid()))
        proc.start()  # the first one waits for the server's imports
        pid, wait = proc.pid, lambda: proc.join() or proc.exitcode
    else:
        env = {**os.environ, **({"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)} if threads else {})}
        command = [*(launcher or [sys.executable]), *entry.argv(root), *args]
        with open(log, "ab") as out:
            popen = subprocess.Popen(
                [sys.executable, "-c", DIE_WITH_PARENT, str(os.getpid()), *command],
                cwd=root,
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
            )
        pid, wait = popen.pid, popen.wait
    with _LOCK:
        _RUNNING.add(pid)
    try:
        return wait()
    except KeyboardInterrupt:
        interrupt_running()
        wait()
        raise
    finally:
        with _LOCK:
            _RUNNING.discard(pid)


def stop() -> None:
    """Stop the fork server once its runs are done (its CPU time then counts in this process's
    children's: ``resource.getrusage``)."""
    server = getattr(multiprocessing.forkserver, "_forkserver", None)
    if _context.cache_info().currsize and hasattr(server, "_stop"):
        server._stop()


def children_cpu() -> float:
    """CPU seconds of this process's finished runs (a forked run's once :func:`stop` has run)."""
    import resource

    used = resource.getrusage(resource.RUSAGE_CHILDREN)
    return used.ru_utime + used.ru_stime


def cores() -> int:
    """The CPU cores this process may use."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def interrupt_running() -> None:
    """Ctrl-C: SIGINT to every run going on (a terminal's reached them already; train/trainer/interrupt.py
    counts the two as one)."""
    with _LOCK:
        for pid in _RUNNING:
            try:
                os.kill(pid, signal.SIGINT)
            except ProcessLookupError:
                pass


@contextlib.contextmanager
def interrupt_on_signals() -> Iterator[None]:
    """Inside, SIGINT and SIGTERM raise KeyboardInterrupt, so that the runs save a checkpoint and
    stop, even where this process's launcher left SIGINT ignored (a shell does for a background
    job). Enter it before the first run: the fork server inherits it."""
    with routed(_raise_interrupt):
        yield


def _raise_interrupt(signum, frame) -> None:
    raise KeyboardInterrupt(signal.Signals(signum).name)


#: ``prctl(PR_SET_PDEATHSIG)``'s option number (linux/prctl.h).
_PR_SET_PDEATHSIG = 1


def stop_with_parent(parent: int) -> None:
    """Have the kernel send this process SIGTERM when its parent dies (a sweep killed with SIGKILL
    runs no handler of its own): the run saves at the end of its step and stops, instead of training
    on as an orphan that a relaunched sweep finds holding its point. Linux only; elsewhere a no-op.
    ``parent``: the pid it must still have (it may have died already)."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    if os.getppid() != parent:  # gone before the request: no signal will come
        os.kill(os.getpid(), signal.SIGTERM)


def stop_with(sweep: int) -> None:
    """SIGTERM to this process once the process ``sweep`` has ended, from a thread that waits on it
    (a pidfd). A forked run's parent is the fork server, which every run it forked keeps alive (each
    holds the server's "alive" pipe), so the kernel's parent-death signal never comes when the
    sweep is killed; the sweep's own end is what counts. Where pidfds are missing: a no-op."""
    import select

    try:
        fd = os.pidfd_open(sweep)
    except (AttributeError, OSError):  # no pidfd here, or the sweep is gone already
        if not _alive(sweep):
            os.kill(os.getpid(), signal.SIGTERM)
        return

    def wait() -> None:
        select.select([fd], [], [])
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=wait, name="stop-with-the-sweep", daemon=True).start()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


#: What a run started as a subprocess is started by: :func:`stop_with_parent`, then the run's own
#: command in its place (exec keeps the request): ``python -c DIE_WITH_PARENT PARENT_PID COMMAND...``.
DIE_WITH_PARENT = (
    "import os, sys; from crystal_grpo.train.tools.launch import stop_with_parent; "
    "stop_with_parent(int(sys.argv[1])); os.execvp(sys.argv[2], sys.argv[2:])"
)


def _child(entry: Entry, args: list[str], log: str, root: str, threads: int | None, sweep: int) -> None:
    """The forked run: as ``python SCRIPT ARGS`` would start it, its output into ``log``; it stops
    (SIGTERM: after a save) when the sweep, process ``sweep``, is gone."""
    stop_with(sweep)
    os.chdir(root)
    sys.stdout.flush()
    sys.stderr.flush()
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    if threads:
        import torch

        os.environ["OMP_NUM_THREADS"] = os.environ["MKL_NUM_THREADS"] = str(threads)
        torch.set_num_threads(threads)
    script = Path(root, entry.script)
    sys.argv = [entry.script if script.is_file() else entry.module, *args]
    sys.path[0] = str(script.parent if script.is_file() else root)  # as the interpreter sets it
    try:
        code = importlib.import_module(entry.module).main(args)
    finally:
        atexit._run_exitfuncs()  # what an interpreter's exit runs (a forked child skips it)
    sys.exit(code)

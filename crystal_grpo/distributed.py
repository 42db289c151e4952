"""Which process this is, and the few collective operations outside TRL's own, in one place.

Reward statistics and validation need every process's rows, and the trainer's guards need
every process to agree; they run outside TRL's own gathers, so they use ``torch.distributed``
directly when it is initialised and are a no-op in one process. Whether this process prints
and writes the run's files is :func:`is_main_process` (accelerate's state; the launcher's
``RANK`` before it is set up), the one place the rank is read for that (docs/training.md:
what is printed, what is logged).
"""

from __future__ import annotations

import os
import sys
from typing import Any


def accelerate_state() -> Any:
    """accelerate's ``PartialState`` once something set it up (the trainer, a launcher's worker),
    else None; neither imports accelerate nor sets it up (``PartialState()`` would). A set-up
    that failed half-way (no process group could be made) counts as none: it has no rank."""
    state = sys.modules.get("accelerate.state")
    shared = state.PartialState._shared_state if state is not None else {}
    return state.PartialState() if "process_index" in shared and "distributed_type" in shared else None


def is_main_process() -> bool:
    """Whether this process is the main one (rank 0), the one that prints and writes the run's
    files: accelerate's state once it is set up; before that (the config check, the run folder's
    lock) the rank the launcher gave it (``RANK``, what accelerate reads too), read without
    importing torch or accelerate, so ``--check`` stays light."""
    state = accelerate_state()
    return state.is_main_process if state is not None else int(os.environ.get("RANK", "0")) == 0


#: What torch's ``env://`` rendezvous reads: a launcher (torchrun, ``accelerate launch``, a
#: Slurm script) sets all of them for each process it starts.
LAUNCHER_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def launcher_problem(env: dict | None = None) -> str | None:
    """What is wrong with the environment when a launcher's variables are only partly there
    (``LOCAL_RANK=0`` left exported in a shell, ``RANK``/``WORLD_SIZE`` without a rendezvous
    address): transformers would try to join a process group and fail after loading, with a
    message about ``MASTER_ADDR``. One process with none of them set is fine."""
    env = os.environ if env is None else env
    given = [k for k in LAUNCHER_VARIABLES if env.get(k)]
    for k, low in (("RANK", 0), ("LOCAL_RANK", 0), ("WORLD_SIZE", 1)):
        if env.get(k) and not (env[k].strip().isdigit() and int(env[k]) >= low):
            return (
                f"environment: {k}={env[k]!r}: a launcher sets it to a whole number >= {low}; unset it for one "
                "process, or start several with torchrun or accelerate launch"
            )
    wants_group = env.get("LOCAL_RANK") or int(env.get("WORLD_SIZE") or 1) > 1
    missing = [k for k in LAUNCHER_VARIABLES if not env.get(k)]
    if not wants_group or not missing:
        return None
    shown = ", ".join(f"{k}={env[k]}" for k in given)
    return (
        f"environment: {shown} set, as a launcher sets them for each process, but not {', '.join(missing)}: "
        f"start several processes with torchrun or accelerate launch, or unset {', '.join(given)} for one"
    )


def wait_for_every_process(timeout_s: float = 120) -> None:
    """On an error path before the run set up its process group: wait until every process of
    the launch reaches it too. A launcher stops the other processes as soon as one exits, so a
    process exiting first could cut off the main process's message. A no-op in one process,
    or when no process group can be made (a process already gone)."""
    if launcher_problem() is not None or int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return
    import datetime

    import torch.distributed as dist

    try:
        own = not dist.is_initialized()
        if own:
            dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=timeout_s))
        dist.barrier()
        if own:
            dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - best effort: the error itself is already printed
        pass


def release_process_group() -> None:
    """Destroy the process group a run made, before the process exits (torch's advice): left to
    interpreter shutdown, gloo's threads can abort a process whose run finished (SIGABRT,
    "terminate called without an active exception"). A no-op without one; torch not imported."""
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def rank_and_world() -> tuple[int, int]:
    """This process's rank and the world size (0, 1 without torch.distributed)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def gather_objects(values: list[Any]) -> tuple[list[Any], int]:
    """All processes' items in rank order, and where this process's items start."""
    import torch.distributed as dist

    rank, world = rank_and_world()
    if world == 1:
        return list(values), 0
    parts: list[list[Any]] = [None] * world  # type: ignore[list-item]
    dist.all_gather_object(parts, list(values))
    return [v for p in parts for v in p], sum(len(p) for p in parts[:rank])


def all_ranks(ok: Any, device: Any = None) -> bool:
    """True when ``ok`` (a bool or a one-element tensor) holds on every process; a collective:
    every rank calls it (under ZeRO each rank sees only its part of the gradients, the disk of
    its own node)."""
    import torch
    import torch.distributed as dist

    flag = ok.float() if isinstance(ok, torch.Tensor) else torch.tensor(float(ok), device=device)
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item() > 0)


def even_share(n: int, rank: int, world: int) -> tuple[list[int], int]:
    """Process ``rank``'s indices of ``n`` items (``rank``, ``rank + world``, ...) padded to
    ceil(n / world) with repeats of the first items, and how many are its own (the results of
    the repeats are dropped). Every process then generates as often: under DeepSpeed ZeRO-3
    ``generate`` takes a collective step with the other processes at every token
    (transformers' ``synced_gpus``), so a process with fewer rows, or none (fewer rows than
    processes), would leave the others waiting for ever. Padding by looping back to the first
    items is what accelerate's ``even_batches`` does for a Trainer's evaluation."""
    own = list(range(rank, n, world))
    return own + list(range(-(-n // world) - len(own))), len(own)


def barrier() -> None:
    """Wait for every process (a no-op in one process)."""
    import torch.distributed as dist

    if rank_and_world()[1] > 1:
        dist.barrier()


def launcher() -> list[str]:
    """How this process was started, up to its script: ``python`` for a plain run; for a worker,
    its launcher's own command line (torchrun, ``accelerate launch`` ...), read from the parent
    process, so a printed resume command repeats the launcher actually used."""
    from pathlib import Path

    if int(os.environ.get("WORLD_SIZE", "1")) == 1 and "TORCHELASTIC_RUN_ID" not in os.environ:
        return ["python"]
    script = Path(sys.argv[0]).name
    try:
        parent = [a.decode() for a in Path(f"/proc/{os.getppid()}/cmdline").read_bytes().split(b"\0") if a]
    except (OSError, UnicodeDecodeError):
        parent = []
    for i, arg in enumerate(parent):
        if i and Path(arg).name == script:
            return parent[:i]
    return ["accelerate", "launch", "..."]  # a launcher we cannot see (srun without torchrun, ...)


def launch_command(script: str = "train/grpo.py", argv: list[str] | None = None) -> str:
    """This process's command line, its launcher included (:func:`launcher`)."""
    import shlex
    import sys

    args = list(sys.argv[1:] if argv is None else argv)
    return shlex.join([*launcher(), script, *args])
